# Source: torchtune, torchtune/training/_activation_offloading.py,
#   OffloadActivations.unpack_tensor_with_streams.  In backward the offloaded
#   activation is brought back with `maybe_gpu_tensor.to("cuda",
#   non_blocking=True)` under `torch.cuda.stream(self.s1)`, followed by
#   `self.s0.wait_stream(self.s1)` ("Tell comp stream to wait for the info to be
#   loaded before executing"); the brought-back tensor is then protected with
#   record_stream(self.s0).
# Race (bug version): the s0.wait_stream(s1) is missing.  The tensor returned
#   by the unpack hook is consumed by the backward kernels on the compute stream
#   s0 while the H2D copy that fills it is still queued on s1 (device-device RAW
#   between s1 and s0): backward reads uninitialized / recycled memory.
#   Here s1 is kept busy by other offload traffic (a _sleep enqueued on s1
#   before backward), so the H2D copies start late.
# Fix: self.s0.wait_stream(self.s1) after enqueuing the H2D copy.
import torch

SPIN = 20_000_000  # torch.cuda._sleep cycles (~10 ms on H200)


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, param_storages):
        self.s0 = torch.cuda.default_stream()  # compute stream
        self.s1 = torch.cuda.Stream()  # comms stream
        self.param_storages = param_storages
        self.fwd_stash = {}  # tensor_id -> (gpu activation, event)
        self.tensor_id = 0
        super().__init__(self.pack_tensor, self.unpack_tensor)

    def pack_tensor(self, activation):
        if activation.untyped_storage().data_ptr() in self.param_storages:
            return activation
        self.tensor_id += 1
        tensor_id = self.tensor_id
        self.s1.wait_stream(self.s0)
        with torch.cuda.stream(self.s1):
            cpu_tensor = torch.empty(
                activation.shape, dtype=activation.dtype, pin_memory=True
            )
            cpu_tensor.copy_(activation, non_blocking=True)
        event = self.s1.record_event()
        self.fwd_stash[tensor_id] = (activation, event)
        return (tensor_id, cpu_tensor)

    def release_fwd_stash(self):
        for tensor_id in list(self.fwd_stash):
            _, event = self.fwd_stash.pop(tensor_id)
            self.s0.wait_event(event)

    def unpack_tensor(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        self.release_fwd_stash()
        _, cpu_tensor = packed
        # bring the activation back on the comms stream (after its D2H: same stream)
        with torch.cuda.stream(self.s1):
            gpu_tensor = cpu_tensor.to("cuda", non_blocking=True)
        # FIX: backward on s0 must not read the tensor before the H2D on s1 is done
        self.s0.wait_stream(self.s1)
        # allocated on s1, used by backward on s0
        gpu_tensor.record_stream(self.s0)
        return gpu_tensor


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

    ref = [torch.zeros_like(w) for w in weights]
    for x in xs:
        for r, g in zip(ref, torch.autograd.grad(forward(x, weights), weights)):
            r += g
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # start the offloaded run from an empty block cache

    offload = OffloadActivations({w.untyped_storage().data_ptr() for w in weights})
    for x in xs:
        with offload:
            loss = forward(x, weights)
        # other offload traffic keeps the comms stream busy when backward starts
        with torch.cuda.stream(offload.s1):
            torch.cuda._sleep(SPIN)
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
