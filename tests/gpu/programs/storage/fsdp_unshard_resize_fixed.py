# Source: pytorch/pytorch torch/distributed/fsdp/_flat_param.py
#   FlatParamHandle._free_unsharded_flat_param() calls
#   _no_dispatch_record_stream(unsharded_flat_param, current_stream()) before
#   _free_storage() (= untyped_storage().resize_(0)); the padded unsharded flat
#   param is allocated by _alloc_storage() (resize_(n)) inside
#   `with stream(unshard_stream)` in _runtime_utils._unshard().
#   Same pattern: Megatron-FSDP StorageResizeBasedBucketAllocator.free().
# Pattern: per-layer flat parameter gathered on an unshard side stream,
# consumed by the compute (default) stream through a .view(), then freed by
# resizing its storage to 0 bytes; the next layer's resize_(n) on the unshard
# stream gets the same caching-allocator block.
import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
DIM = 2048
LAYERS = 4
BATCH = 256


class FlatParamHandle:
    """Owns one layer's sharded flat parameter and its unsharded copy."""

    def __init__(self, local_shard, unshard_stream):
        self.local_shard = local_shard              # persistent, stays allocated
        self.unshard_stream = unshard_stream
        # padded unsharded flat param; starts with zero-sized storage (FSDP style)
        self.unsharded = torch.empty(local_shard.numel(), device=local_shard.device,
                                     dtype=local_shard.dtype)
        self._free_storage(self.unsharded)

    @staticmethod
    def _alloc_storage(t):
        st = t.untyped_storage()
        if st.size() == 0:
            st.resize_(t.numel() * t.element_size())

    @staticmethod
    def _free_storage(t):
        st = t.untyped_storage()
        if st.size() != 0:
            st.resize_(0)

    def unshard(self):
        # runs under `with torch.cuda.stream(unshard_stream)`
        self._alloc_storage(self.unsharded)
        self.unsharded.copy_(self.local_shard)     # stand-in for all_gather_into_tensor

    def weight_view(self):
        return self.unsharded.view(DIM, DIM)

    def reshard(self):
        unsharded = self.unsharded
        # FIX: do not free until the compute stream's queued reads of this block finish
        unsharded.record_stream(torch.cuda.current_stream())
        self._free_storage(unsharded)


class ShardedLinear(nn.Module):
    def __init__(self, handle):
        super().__init__()
        self.handle = handle

    def forward(self, x):
        torch.cuda._sleep(SLEEP_CYCLES)          # long compute ahead of the read
        return torch.tanh(x @ self.handle.weight_view())


def pre_forward_hook(module, args):
    h = module.handle
    with torch.cuda.stream(h.unshard_stream):
        h.unshard()
    torch.cuda.current_stream().wait_stream(h.unshard_stream)


def post_forward_hook(module, args, output):
    module.handle.reshard()


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    unshard_stream = torch.cuda.Stream()
    shards = [torch.randn(DIM * DIM, device=dev) / DIM ** 0.5 for _ in range(LAYERS)]
    x0 = torch.randn(BATCH, DIM, device=dev)

    # reference: plain sequential forward with the full weights
    ref = x0
    for s in shards:
        ref = torch.tanh(ref @ s.view(DIM, DIM))
    reference = ref.double().sum().item()
    torch.cuda.synchronize()

    layers = nn.Sequential(*[ShardedLinear(FlatParamHandle(s, unshard_stream)) for s in shards])
    for m in layers:
        m.register_forward_pre_hook(pre_forward_hook)
        m.register_forward_hook(post_forward_hook)

    # root pre-forward: unshard stream waits once for the compute stream
    unshard_stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        out = layers(x0)
    checksum = out.double().sum().item()
    torch.cuda.synchronize()
    match = abs(checksum - reference) <= 1e-3 * max(1.0, abs(reference))
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
