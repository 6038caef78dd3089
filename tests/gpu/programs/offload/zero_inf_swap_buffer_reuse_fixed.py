# Source: plausible pattern modelled on DeepSpeed ZeRO-Infinity parameter
#   swapping (deepspeed/runtime/swap_tensor/partitioned_param_swapper.py,
#   AsyncPartitionedParameterSwapper: parameters are read from NVMe into a
#   small pool of pinned swap buffers, then copied to the GPU; buffers are
#   recycled for later swap-ins) with layer-ahead prefetch as in ZeRO-3.
# Race (bug version): two pinned staging buffers are used round-robin.  For
#   layer l the host "reads from NVMe" (a CPU copy_ into pinned[l % 2]) and
#   enqueues a non_blocking H2D from that buffer on the swap stream.  The H2D
#   for layer l cannot start before the GPU buffer it overwrites is released
#   by the compute of layer l-2, so it may still be queued when the host,
#   two swap-ins later, refills the same pinned buffer with layer l+2's
#   weights (host-device WAR on pinned memory, no synchronize): layer l then
#   computes with layer l+2's weights.
# Fix: before the host writes a pinned buffer, synchronize on the event
#   recorded after the last H2D that read it.
import torch

SPIN = 20_000_000  # torch.cuda._sleep cycles (~10 ms on H200)


class ParamSwapper:
    def __init__(self, nvme_store, num_buffers=2):
        self.nvme_store = nvme_store  # pageable CPU tensors standing in for NVMe
        shape = nvme_store[0].shape
        self.pinned = [torch.empty(shape, pin_memory=True) for _ in range(num_buffers)]
        self.gpu = [torch.empty(shape, device="cuda") for _ in range(num_buffers)]
        self.h2d_done = [torch.cuda.Event() for _ in range(num_buffers)]
        self.gpu_free = [torch.cuda.Event() for _ in range(num_buffers)]
        self.swap_stream = torch.cuda.Stream()

    def swap_in(self, layer):
        slot = layer % len(self.pinned)
        # FIX: the previous H2D out of this pinned buffer must be finished
        self.h2d_done[slot].synchronize()
        self.pinned[slot].copy_(self.nvme_store[layer])  # host: aio read into pinned buffer
        with torch.cuda.stream(self.swap_stream):
            # do not overwrite the GPU buffer while a layer still computes with it
            self.swap_stream.wait_event(self.gpu_free[slot])
            self.gpu[slot].copy_(self.pinned[slot], non_blocking=True)
            self.h2d_done[slot].record(self.swap_stream)
        return slot

    def get(self, slot):
        torch.cuda.current_stream().wait_event(self.h2d_done[slot])
        return self.gpu[slot]

    def release(self, slot):
        self.gpu_free[slot].record(torch.cuda.current_stream())


def main():
    torch.manual_seed(0)
    B, D, L, MICRO = 2048, 2048, 8, 3
    nvme_store = [torch.randn(D, D) / D**0.5 for _ in range(L)]
    inputs = [torch.randn(B, D) for _ in range(MICRO)]

    gpu_weights = [w.cuda() for w in nvme_store]
    ref = []
    for x in inputs:
        h = x.cuda()
        for w in gpu_weights:
            h = torch.tanh(h @ w)
        ref.append(h)
    torch.cuda.synchronize()
    del gpu_weights

    swapper = ParamSwapper(nvme_store)
    outs = []
    for x in inputs:
        h = x.cuda()
        slot = swapper.swap_in(0)
        for layer in range(L):
            nxt = swapper.swap_in(layer + 1) if layer + 1 < L else None  # prefetch
            w = swapper.get(slot)
            torch.cuda._sleep(SPIN)  # stands in for the rest of the layer's compute
            h = torch.tanh(h @ w)
            swapper.release(slot)
            slot = nxt
        outs.append(h)
    torch.cuda.synchronize()

    out = torch.stack(outs)
    refs = torch.stack(ref)
    checksum = out.double().sum().item()
    err = (out - refs).abs().max().item() / refs.abs().max().item()
    print(f"checksum={checksum:.8e} rel_err_vs_ref={err:.3e}",
          "OK" if err < 1e-5 else "MISMATCH")


if __name__ == "__main__":
    main()
