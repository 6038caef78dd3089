# Source: PyTorch FSDP1, torch/distributed/fsdp/_flat_param.py: FlatParamHandle.unshard() ->
#   _alloc_padded_unsharded_flat_param() -> torch.distributed.utils._alloc_storage (storage resize_(n)), run under
#   `with state._device_handle.stream(unshard_stream)` by _runtime_utils._unshard(); and
#   FlatParamHandle._free_unsharded_flat_param(), which calls
#   _no_dispatch_record_stream(unsharded_flat_param, current_stream()) and then _free_storage (storage resize_(0)).
#   Configuration modelled: forward_prefetch=True, limit_all_gathers=False (no rate-limiter host sync).
# Bug: the padded unsharded flat parameter of layer i is (re)allocated by UntypedStorage.resize_(n) while the
#   unshard stream is current, so its block belongs to unshard_stream. Layer i's matmul reads it on the default
#   (compute) stream, then post-forward reshard frees it with resize_(0) WITHOUT record_stream(compute stream).
#   When pre-forward of layer i+1 prefetches layer i+2, resize_(n) on unshard_stream gets the same block at once and
#   the emulated all-gather (copy_ on unshard_stream) overwrites it while layer i's matmul on the default stream has
#   not read it yet: no edge orders the compute stream's read before the unshard stream's write.
# Fix: reshard() records the compute stream on the flat parameter before resize_(0) (what FSDP1 does with
#   _no_dispatch_record_stream), so the allocator keeps the block until the compute work enqueued so far is done.
import torch
import torch.nn as nn

WORLD_SIZE = 4              # emulated sharding degree; peers' shards live on this GPU, all-gather = copies
NUM_LAYERS = 6
HIDDEN = 1024
COMPUTE_DELAY = 30_000_000  # cycles of GPU sleep per layer on the compute stream (a slow layer)


def _alloc_storage(tensor: torch.Tensor, size: torch.Size) -> None:
    """torch.distributed.utils._alloc_storage: re-materialize a freed storage in place."""
    storage = tensor.untyped_storage()
    nbytes = size.numel() * tensor.element_size()
    if storage.size() != nbytes:
        assert storage.size() == 0, "storage must be freed before being re-allocated"
        storage.resize_(nbytes)


def _free_storage(tensor: torch.Tensor) -> None:
    """torch.distributed.utils._free_storage: drop the memory but keep the tensor (and its views) around."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        assert tensor.storage_offset() == 0
        storage.resize_(0)


class FlatParamHandle:
    def __init__(self, module: nn.Module):
        self.module = module
        self.param_infos = [(n, p.shape, p.numel()) for n, p in module.named_parameters()]
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
            pad = (-flat.numel()) % WORLD_SIZE
            flat = torch.cat([flat, flat.new_zeros(pad)])
        self._padded_unsharded_size = flat.size()
        chunks = flat.chunk(WORLD_SIZE)
        self._shard_numel = chunks[0].numel()
        self._local_shard = chunks[0].clone()                 # what this rank keeps between uses
        self._peer_shards = [c.clone() for c in chunks]       # what the all-gather would bring in
        for name, _, _ in self.param_infos:                   # use_orig_params=False: plain tensor attributes
            delattr(module, name)
            setattr(module, name, torch.empty(0, device=flat.device))
        self._full_param_padded = torch.empty_like(flat)
        _free_storage(self._full_param_padded)
        self.prefetched = False

    def unshard(self) -> None:
        """Runs with unshard_stream current (FSDP _unshard)."""
        _alloc_storage(self._full_param_padded, self._padded_unsharded_size)
        for r, shard in enumerate(self._peer_shards):        # all_gather_into_tensor(full, local_shard)
            self._full_param_padded.narrow(0, r * self._shard_numel, self._shard_numel).copy_(shard)
        offset = 0
        for name, shape, numel in self.param_infos:          # _use_unsharded_views
            setattr(self.module, name, self._full_param_padded.narrow(0, offset, numel).view(shape))
            offset += numel

    def reshard(self) -> None:
        """_free_unsharded_flat_param, on the compute stream after the layer's forward was enqueued."""
        _free_storage(self._full_param_padded)


def fsdp_forward(handles, layers, x, unshard_stream):
    compute = torch.cuda.current_stream()
    for i, (handle, layer) in enumerate(zip(handles, layers)):
        if not handle.prefetched:                             # _pre_forward_unshard
            with torch.cuda.stream(unshard_stream):
                handle.unshard()
        compute.wait_stream(unshard_stream)
        if i + 1 < len(handles):                              # forward_prefetch of the next handle
            with torch.cuda.stream(unshard_stream):
                handles[i + 1].unshard()
            handles[i + 1].prefetched = True
        torch.cuda._sleep(COMPUTE_DELAY)
        x = torch.relu(layer(x))
        handle.reshard()                                      # _post_forward -> _reshard
        handle.prefetched = False
    return x


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    layers = [nn.Linear(HIDDEN, HIDDEN, device=dev) for _ in range(NUM_LAYERS)]
    ref_weights = [(l.weight.detach().clone(), l.bias.detach().clone()) for l in layers]
    handles = [FlatParamHandle(l) for l in layers]
    unshard_stream = torch.cuda.Stream()
    inputs = [torch.randn(256, HIDDEN, device=dev) for _ in range(2)]
    torch.cuda.synchronize()

    with torch.no_grad():
        outs = [fsdp_forward(handles, layers, x, unshard_stream) for x in inputs]
        torch.cuda.synchronize()
        ok = True
        for x, out in zip(inputs, outs):
            ref = x
            for w, b in ref_weights:
                ref = torch.relu(torch.nn.functional.linear(ref, w, b))
            ok = ok and torch.allclose(out, ref, rtol=1e-4, atol=1e-4)
    print(f"match={ok}")


if __name__ == "__main__":
    main()
