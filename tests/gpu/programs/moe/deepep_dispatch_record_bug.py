# Source: deepseek-ai/DeepEP csrc/deep_ep.cpp + deep_ep/utils.py, as used by NVIDIA/Megatron-LM
#   megatron/core/transformer/moe/fused_a2a.py (FusedDispatch). With async_finish=True, Buffer::dispatch
#   makes its comm stream wait on previous_event, runs the kernel there, returns an EventOverlap, and
#   calls t.record_stream(comm_stream) on every tensor the comm stream touched (input x and the
#   outputs allocated on the compute stream), because the caller is free to drop x right away.
#   The comm stream lives in the C++ runtime; Python sees it through its raw handle (ExternalStream).
# Bug (deepep_dispatch_record_bug.py): dispatch() records only the tensors it returns, not the input
#   x; the MoE layer drops x right after dispatch, the caching allocator hands x's block to the next
#   same-size allocation on the compute stream (the shared-expert input), which is written while the
#   comm stream's gather has not yet read x.
# Fix (deepep_dispatch_record_fixed.py): x.record_stream(comm_stream) as well.
import torch
import torch.nn.functional as F

SLEEP_CYCLES = 20_000_000  # ~10 ms on the comm stream (stands in for waiting on remote ranks)
H, FFN, E, T, LAYERS = 256, 512, 4, 2048, 2
DEV = torch.device("cuda:0")


class EventOverlap:
    """Event plus optional tensors kept alive until the event is waited on (deep_ep.utils)."""

    def __init__(self, event, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        torch.cuda.current_stream().wait_event(self.event)


class CommBuffer:
    def __init__(self):
        self._runtime_stream = torch.cuda.Stream()  # owned by the "C++ runtime"
        self.comm_stream = torch.cuda.ExternalStream(self._runtime_stream.cuda_stream)

    def dispatch(self, x, recv_order, previous_event):
        # outputs are allocated on the compute stream (allocate_on_comm_stream=False)
        recv_x = torch.empty_like(x)
        self.comm_stream.wait_event(previous_event.event)
        with torch.cuda.stream(self.comm_stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            torch.index_select(x, 0, recv_order, out=recv_x)  # the "all-to-all" on one GPU
        event = EventOverlap(self.comm_stream.record_event())
        for t in (recv_order, recv_x):
            t.record_stream(self.comm_stream)
        return recv_x, event


def expert_mlp(tokens, top_expert_sorted, w1, w2):
    out = torch.zeros_like(tokens)
    for e in range(E):
        mask = (top_expert_sorted == e).to(tokens.dtype)[:, None]
        out += (F.silu(tokens @ w1[e]) @ w2[e]) * mask
    return out


def moe_layer(h, params, buffer):
    router, w1, w2, norm_w, shared_w = params
    x = F.layer_norm(h, (H,), weight=norm_w)              # dispatch input, allocated on compute stream
    top_expert = (x @ router).argmax(dim=-1)
    recv_order = torch.argsort(top_expert, stable=True)
    previous_event = EventOverlap(torch.cuda.current_stream().record_event())
    recv_x, done = buffer.dispatch(x, recv_order, previous_event)
    del x  # Megatron drops its reference once the dispatcher owns the tokens

    shared_in = F.layer_norm(h, (H,), weight=norm_w * 0.5)  # same size as x: reuses its block
    shared_out = F.silu(shared_in @ shared_w) @ shared_w.t()

    done.current_stream_wait()
    expert_out = expert_mlp(recv_x, top_expert.index_select(0, recv_order), w1, w2)
    combined = torch.empty_like(expert_out)
    combined[recv_order] = expert_out
    return h + combined + shared_out


def moe_layer_reference(h, params):
    router, w1, w2, norm_w, shared_w = params
    x = F.layer_norm(h, (H,), weight=norm_w)
    top_expert = (x @ router).argmax(dim=-1)
    shared_in = F.layer_norm(h, (H,), weight=norm_w * 0.5)
    shared_out = F.silu(shared_in @ shared_w) @ shared_w.t()
    return h + expert_mlp(x, top_expert, w1, w2) + shared_out


@torch.no_grad()
def main():
    torch.manual_seed(0)
    params = [
        (
            torch.randn(H, E, device=DEV),
            torch.randn(E, H, FFN, device=DEV) * H ** -0.5,
            torch.randn(E, FFN, H, device=DEV) * FFN ** -0.5,
            1.0 + 0.1 * torch.randn(H, device=DEV),
            torch.randn(H, FFN, device=DEV) * H ** -0.5,
        )
        for _ in range(LAYERS)
    ]
    x = torch.randn(T, H, device=DEV)
    torch.cuda.synchronize()

    ref = x
    for p in params:
        ref = moe_layer_reference(ref, p)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # start the overlapped run with no cached free blocks

    buffer = CommBuffer()
    h = x
    for p in params:
        h = moe_layer(h, p, buffer)
    torch.cuda.synchronize()

    checksum = h.double().abs().sum().item()
    reference = ref.double().abs().sum().item()
    match = torch.allclose(h, ref, rtol=1e-3, atol=1e-3)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
