# Source: NVIDIA/Megatron-LM megatron/core/transformer/moe/fused_a2a.py (FusedCombine /
#   FusedDispatch autograd Functions over DeepEP: forward and backward each build
#   previous_event = EventOverlap(EventHandle()) on the current stream, the comm stream waits on it,
#   and after_event.current_stream_wait() joins back) and deepseek-ai/DeepEP deep_ep/buffer.py
#   (previous_event / async_finish / allocate_on_comm_stream; tensors allocated on the comm stream
#   are record_stream'ed on the compute stream).
#   The comm helper below only waits when it is given a previous_event, so overlap with unrelated
#   compute is possible; the caller must pass one whenever its input was just produced.
# Bug (combine_backward_event_bug.py): OverlappedCombine.backward calls the comm helper without a
#   previous_event, so the comm stream gathers grad_output before the backward stream (delayed by
#   the layers above) has written it.
# Fix (combine_backward_event_fixed.py): record previous_event on the backward's current stream.
import torch
import torch.nn.functional as F

SLEEP_CYCLES = 20_000_000  # ~10 ms on the backward stream (stands in for the layers above the MoE)
H, T, E = 256, 2048, 4
DEV = torch.device("cuda:0")
COMM_STREAM = None


def comm_stream():
    global COMM_STREAM
    if COMM_STREAM is None:
        COMM_STREAM = torch.cuda.Stream()
    return COMM_STREAM


def run_on_comm(fn, *inputs, previous_event=None):
    """Run fn on the comm stream (allocate_on_comm_stream=True) and join back (async_finish)."""
    compute, comm = torch.cuda.current_stream(), comm_stream()
    if previous_event is not None:
        comm.wait_event(previous_event)
    with torch.cuda.stream(comm):
        out = fn(*inputs)
    out.record_stream(compute)  # allocated on comm, consumed and freed on compute
    after_event = comm.record_event()
    compute.wait_event(after_event)  # after_event.current_stream_wait()
    return out


def unpermute_scale(rows, order, probs_sorted):
    out = torch.empty_like(rows)
    out.index_copy_(0, order, rows * probs_sorted[:, None])
    return out


def permute_scale(rows, order, probs_sorted):
    return rows.index_select(0, order) * probs_sorted[:, None]


class OverlappedCombine(torch.autograd.Function):
    """y[order[i]] = expert_out[i] * probs_sorted[i], computed on the comm stream."""

    @staticmethod
    def forward(ctx, expert_out, order, probs_sorted):
        ctx.async_finish = True
        previous_event = None
        if ctx.async_finish:
            previous_event = torch.cuda.current_stream().record_event()
        y = run_on_comm(unpermute_scale, expert_out, order, probs_sorted,
                        previous_event=previous_event)
        ctx.save_for_backward(order, probs_sorted)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        order, probs_sorted = ctx.saved_tensors
        previous_event = None
        # FIX: grad_y was just produced on this (backward) stream; make the comm stream wait for it
        if ctx.async_finish:
            previous_event = torch.cuda.current_stream().record_event()
        grad_expert_out = run_on_comm(permute_scale, grad_y, order, probs_sorted,
                                      previous_event=previous_event)
        return grad_expert_out, None, None


def delay_backward(grad):
    torch.cuda._sleep(SLEEP_CYCLES)  # enqueued before the kernel that produces grad_y
    return grad


def moe_forward(x, router, w, use_overlap):
    probs, top = torch.softmax(x.detach() @ router, dim=-1).max(dim=-1)
    order = torch.argsort(top, stable=True)
    permuted = x.index_select(0, order)
    top_sorted = top.index_select(0, order)
    expert_out = torch.zeros_like(permuted)
    for e in range(E):
        expert_out = expert_out + F.silu(permuted @ w[e]) * (top_sorted == e).to(x.dtype)[:, None]
    probs_sorted = probs.index_select(0, order)
    if use_overlap:
        return OverlappedCombine.apply(expert_out, order, probs_sorted)
    return unpermute_scale(expert_out, order, probs_sorted)


def main():
    torch.manual_seed(0)
    router = torch.randn(H, E, device=DEV)
    x0 = torch.randn(T, H, device=DEV)
    w0 = torch.randn(E, H, H, device=DEV) * H ** -0.5
    target = torch.randn(T, H, device=DEV)

    grads = {}
    for use_overlap in (False, True):
        x = x0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        y = moe_forward(x, router, w, use_overlap)
        z = y * 2.0
        if use_overlap:
            z.register_hook(delay_backward)
        loss = (z * target).sum()
        loss.backward()
        torch.cuda.synchronize()
        grads[use_overlap] = torch.cat([x.grad.flatten(), w.grad.flatten()])

    out, ref = grads[True], grads[False]
    checksum = out.double().abs().sum().item()
    reference = ref.double().abs().sum().item()
    match = torch.allclose(out, ref, rtol=1e-3, atol=1e-3)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
