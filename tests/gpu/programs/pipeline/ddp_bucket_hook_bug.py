# Source: pytorch/pytorch torch/csrc/distributed/c10d/reducer.cpp (autograd hooks copy each
#   gradient into its bucket view and launch the bucket's all-reduce as soon as the bucket is
#   full, overlapping communication with the rest of backward) and
#   torch/distributed/fsdp/_runtime_utils.py::_post_backward_hook ("Wait for all ops in the
#   current stream (e.g. gradient computation) to finish before reduce-scattering").
# Pattern: DDP-like gradient bucketing with post-accumulate-grad hooks; the communication
#   stream is a raw cudaStream_t owned by a communication runtime and wrapped with
#   torch.cuda.ExternalStream, as interop code does for NCCL/MPI streams.
import copy

import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
DEV = torch.device("cuda", 0)
WORLD = 4           # simulated data-parallel size: the "all-reduce" averages over WORLD ranks
DIM, ROWS, LAYERS = 1024, 1024, 4
PARAMS_PER_BUCKET = 2
LR = 1e-3


class CommRuntime:
    """Owns the communication stream; callers only get the raw handle (an int)."""

    def __init__(self):
        self._stream = torch.cuda.Stream(device=DEV)
        self.handle = self._stream.cuda_stream

    def all_reduce_mean_(self, flat):
        # stand-in for the collective: DDP pre-divides by the world size before summing across
        # ranks; the cross-rank sum itself is not simulated in this single-process program
        flat.div_(WORLD)


class BucketReducer:
    def __init__(self, params, comm):
        self.comm = comm
        self.comm_stream = torch.cuda.ExternalStream(comm.handle, device=DEV)
        self.buckets, self.pending, self.where = [], [], {}
        order = list(reversed(params))  # gradients become ready in reverse order
        for b in range(0, len(order), PARAMS_PER_BUCKET):
            members = order[b:b + PARAMS_PER_BUCKET]
            flat = torch.zeros(sum(p.numel() for p in members), device=DEV)
            offset = 0
            for p in members:
                self.where[p] = (len(self.buckets), flat[offset:offset + p.numel()])
                offset += p.numel()
            self.buckets.append(flat)
            self.pending.append(len(members))
        self.expected = list(self.pending)
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self.comm_stream.wait_stream(torch.cuda.current_stream())  # buckets were zero-filled

    def _grad_ready(self, param):
        b, view = self.where[param]
        with torch.cuda.stream(self.comm_stream):
            view.copy_(param.grad.view(-1))
            self.pending[b] -= 1
            if self.pending[b] == 0:
                self.comm.all_reduce_mean_(self.buckets[b])

    def finalize(self):
        assert all(n == 0 for n in self.pending), "some buckets were never reduced"
        torch.cuda.current_stream().wait_stream(self.comm_stream)
        self.pending = list(self.expected)


def build_model():
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(DIM, DIM, bias=False), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).to(DEV)


def main():
    torch.manual_seed(0)
    model = build_model()
    ref_model = copy.deepcopy(model)
    x = torch.randn(ROWS, DIM, device=DEV)

    ref_model(x).sum().backward()
    ref_grads = [p.grad / WORLD for p in ref_model.parameters()]
    ref_params = [p.detach() - LR * g for p, g in zip(ref_model.parameters(), ref_grads)]

    params = list(model.parameters())
    comm = CommRuntime()
    reducer = BucketReducer(params, comm)

    loss = model(x).sum()
    torch.cuda._sleep(SLEEP_CYCLES)  # default stream still busy when backward is issued
    loss.backward()
    reducer.finalize()
    with torch.no_grad():
        for p in params:
            p.add_(reducer.where[p][1].view_as(p), alpha=-LR)

    torch.cuda.synchronize()
    checksum = sum(p.detach().double().sum().item() for p in params)
    reference = sum(p.double().sum().item() for p in ref_params)
    ok = all(torch.allclose(p.detach(), r, rtol=1e-4, atol=1e-5) for p, r in zip(params, ref_params))
    torch.cuda.synchronize()
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={ok}")


if __name__ == "__main__":
    main()
