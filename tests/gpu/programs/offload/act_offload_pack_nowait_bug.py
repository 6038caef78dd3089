# Source: torchtune, torchtune/training/_activation_offloading.py,
#   OffloadActivations.pack_tensor (use_streams=True).  The real hook runs
#   `self.s1.wait_stream(self.s0)` ("Sync in, offload, and add an event to sync
#   back later") right before `cpu_tensor.copy_(activation, non_blocking=True)`
#   on the comms stream s1, and keeps the activation alive in fwd_stash until
#   s0 waited on the copy's event.
# Race (bug version): the s1.wait_stream(s0) is missing.  The activation handed
#   to the saved-tensor pack hook was produced by a kernel that has only been
#   *enqueued* on the compute stream s0.  The D2H copy on s1 has no ordering edge
#   to that kernel, so it may copy the activation's memory before it was written
#   (device-device RAW between s0 and s1).  Backward then restores the stale CPU
#   copy and produces wrong gradients.
# Fix: self.s1.wait_stream(self.s0) before the offload copy.
import torch

SPIN = 20_000_000  # torch.cuda._sleep cycles (~10 ms on H200): keeps s0 busy


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, param_storages):
        self.s0 = torch.cuda.default_stream()  # compute stream
        self.s1 = torch.cuda.Stream()  # comms stream
        self.param_storages = param_storages
        self.fwd_stash = {}  # tensor_id -> (gpu activation, event)
        self.tensor_id = 0
        super().__init__(self.pack_tensor, self.unpack_tensor)

    def pack_tensor(self, activation):
        # parameters are not offloaded
        if activation.untyped_storage().data_ptr() in self.param_storages:
            return activation
        self.tensor_id += 1
        tensor_id = self.tensor_id
        # (missing: self.s1.wait_stream(self.s0))
        with torch.cuda.stream(self.s1):
            cpu_tensor = torch.empty(
                activation.shape, dtype=activation.dtype, pin_memory=True
            )
            cpu_tensor.copy_(activation, non_blocking=True)
        event = self.s1.record_event()
        # keep the activation alive until s0 has waited on the copy
        self.fwd_stash[tensor_id] = (activation, event)
        return (tensor_id, cpu_tensor, event)

    def release_fwd_stash(self):
        for tensor_id in list(self.fwd_stash):
            _, event = self.fwd_stash.pop(tensor_id)
            self.s0.wait_event(event)

    def unpack_tensor(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        self.release_fwd_stash()
        _, cpu_tensor, event = packed
        self.s0.wait_event(event)  # D2H finished before we read the CPU copy
        return cpu_tensor.to("cuda", non_blocking=True)


def forward(x, weights):
    h = x
    for w in weights:
        h = torch.tanh(h @ w)
    return h.square().mean()


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    B, D, L, STEPS = 4096, 1024, 4, 4
    weights = [
        (torch.randn(D, D, device=dev) / D**0.5).requires_grad_() for _ in range(L)
    ]
    xs = [torch.randn(B, D, device=dev) for _ in range(STEPS)]

    # reference gradients: plain autograd, no offloading
    ref = [torch.zeros_like(w) for w in weights]
    for x in xs:
        for r, g in zip(ref, torch.autograd.grad(forward(x, weights), weights)):
            r += g
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # start the offloaded run from an empty block cache

    offload = OffloadActivations({w.untyped_storage().data_ptr() for w in weights})
    for x in xs:
        torch.cuda._sleep(SPIN)  # compute stream busy: forward kernels queue behind
        with offload:
            loss = forward(x, weights)
        loss.backward()
    torch.cuda.synchronize()

    grads = [w.grad for w in weights]
    checksum = sum(g.double().sum().item() for g in grads)
    scale = max(r.abs().max().item() for r in ref)
    err = max((g - r).abs().max().item() for g, r in zip(grads, ref)) / scale
    print(f"checksum={checksum:.8e} rel_err_vs_ref={err:.3e}",
          "OK" if err < 1e-5 else "MISMATCH")


if __name__ == "__main__":
    main()
