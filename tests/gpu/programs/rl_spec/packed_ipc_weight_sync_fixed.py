# Source: vllm-project/vllm vllm/distributed/weight_transfer/packed_tensor.py, packed_ipc_producer()
#   (trainer side: pack bf16-cast parameters into one reusable CUDA-IPC buffer, yield a
#   PackedIpcChunk per bucket) and unpack_tensor() + load_weights on the rollout worker, the
#   colocated trainer -> rollout weight-sync path used by RL post-training (verl / OpenRLHF / TRL
#   style "update_weights_from_ipc").
# Bug: the producer fills ipc_buffer with copy_ on the trainer's (default) stream, which is still
#   busy with the optimizer step, and yields the chunk without draining that stream. The rollout
#   worker unpacks the bucket and copies it into its own weights on its load stream; that stream
#   has no happens-before edge to the default stream's copy_ into ipc_buffer, so it reads the
#   bucket before it was written (device-device RAW on ipc_buffer) -> stale rollout weights.
# Fix: torch.cuda.current_stream().synchronize() before every yield ("Drain queued copies so the
#   consumer sees a fully-written buffer"), as vLLM does.
from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda:0")
NUM_LAYERS = 6
HIDDEN = 512
INTERMEDIATE = 1536
BUFFER_SIZE_BYTES = 4 * 1024 * 1024


@dataclass
class PackedIpcChunk:
    names: list
    shapes: list
    dtypes: list
    tensor_sizes: list


class PolicyModel(torch.nn.Module):
    """fp32 master weights held by the trainer."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for _ in range(NUM_LAYERS):
            layer = torch.nn.Module()
            layer.qkv_proj = torch.nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
            layer.o_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
            layer.gate_up_proj = torch.nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False)
            layer.down_proj = torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=False)
            self.layers.append(layer)


def optimizer_step(model):
    # The optimizer kernels are still queued on the trainer's stream when weight sync starts.
    torch.cuda._sleep(50_000_000)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.999).add_(0.01)


def _plan_buckets(named_params, buffer_size_bytes):
    buckets, cur, cur_bytes = [], [], 0
    for name, p in named_params:
        nbytes = p.numel() * torch.bfloat16.itemsize
        if cur and cur_bytes + nbytes > buffer_size_bytes:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, p))
        cur_bytes += nbytes
    if cur:
        buckets.append(cur)
    return buckets


def packed_ipc_producer(named_params, post_iter_func, buffer_size_bytes=BUFFER_SIZE_BYTES):
    ipc_buffer = torch.empty(buffer_size_bytes, dtype=torch.uint8, device=DEVICE)
    for bucket in _plan_buckets(named_params, buffer_size_bytes):
        names, shapes, dtypes, tensor_sizes = [], [], [], []
        total_bytes = 0
        for name, orig_tensor in bucket:
            flat = post_iter_func((name, orig_tensor)).contiguous().view(torch.uint8).view(-1)
            ipc_buffer[total_bytes:total_bytes + flat.numel()].copy_(flat)
            names.append(name)
            shapes.append(list(orig_tensor.shape))
            dtypes.append(torch.bfloat16)
            tensor_sizes.append(flat.numel())
            total_bytes += flat.numel()
        # Drain queued copies so the consumer sees a fully-written buffer.
        torch.cuda.current_stream().synchronize()
        yield ipc_buffer, PackedIpcChunk(names, shapes, dtypes, tensor_sizes)


def unpack_tensor(packed_tensor, names, shapes, dtypes, tensor_sizes):
    unpacked = packed_tensor.split(tensor_sizes)
    return [(n, t.contiguous().view(d).view(*s)) for n, s, d, t in zip(names, shapes, dtypes, unpacked)]


class RolloutWorker:
    """The inference engine's copy of the policy (bf16), loaded on its own stream."""

    def __init__(self, model):
        self.load_stream = torch.cuda.Stream(device=DEVICE)
        self.weights = {n: torch.zeros(p.shape, dtype=torch.bfloat16, device=DEVICE)
                        for n, p in model.named_parameters()}

    def update_weights_from_ipc(self, ipc_buffer, chunk):
        with torch.cuda.stream(self.load_stream):
            packed = ipc_buffer[:sum(chunk.tensor_sizes)]
            for name, tensor in unpack_tensor(packed, chunk.names, chunk.shapes, chunk.dtypes,
                                              chunk.tensor_sizes):
                self.weights[name].copy_(tensor)
        # The RPC returns (ray.get on the trainer) only once the load has finished.
        self.load_stream.synchronize()


def main():
    torch.manual_seed(0)
    model = PolicyModel().to(DEVICE)
    rollout = RolloutWorker(model)
    torch.cuda.synchronize()

    for it in range(2):
        optimizer_step(model)
        named = list(model.named_parameters())
        for ipc_buffer, chunk in packed_ipc_producer(
                named, post_iter_func=lambda item: item[1].detach().to(torch.bfloat16)):
            rollout.update_weights_from_ipc(ipc_buffer, chunk)

        torch.cuda.synchronize()
        ok = all(torch.equal(rollout.weights[n], p.detach().to(torch.bfloat16)) for n, p in named)
        print(f"iteration {it}: rollout weights in sync = {ok}")

    torch.cuda.synchronize()
    match = all(torch.equal(rollout.weights[n], p.detach().to(torch.bfloat16))
                for n, p in model.named_parameters())
    print(f"match={match}")


if __name__ == "__main__":
    main()
