# Source: NVIDIA TransformerEngine, transformer_engine/pytorch/graph.py make_graphed_callables(..., fp8_enabled=True)
#   together with transformer_engine/pytorch/fp8.py FP8GlobalStateManager.reduce_and_update_fp8_tensors /
#   _default_get_amax_and_update_history + _default_sf_compute (delayed scaling: amax_history rolled by one,
#   history[0] zeroed for the next step, scale = fp8_max / max(amax_history) / 2**margin). The graphed FP8
#   forward is replayed on the side stream it was captured on, while the eager delayed-scaling update runs on
#   the default stream after every step, as in a graph runner that keeps the global fp8 meta buffers
#   (global_amax_history_buffer / global_scale_buffer) outside the graph.
# Bug: the default stream waits for graph_stream before the update (so it sees the new amax), but the next
#   replay is enqueued on graph_stream without waiting for the default stream. Replay k+1 reads
#   fp8_meta.scale (and writes fp8_meta.amax_history[0]) while the update of step k on the default stream, which
#   rewrites both tensors, is still queued behind the simulated amax all-reduce: step k+1 quantizes with a stale
#   scale and the history gets clobbered. Race: default-stream write of scale/amax_history vs graph_stream
#   read of scale / write of amax_history[0] during replay.
# Fix: record an event on the default stream after amax_and_scale_update() and make graph_stream wait on it
#   before the next replay.
import torch

DEV = "cuda:0"
FP8_MAX = 448.0  # torch.float8_e4m3fn
HIST_LEN = 4
N_LAYERS = 3
HIDDEN = 512
TOKENS = 256
STEPS = 8
MAGS = [1.0, 6.0, 0.5, 12.0, 2.0, 24.0, 1.0, 40.0]  # activation magnitude per step
ALLREDUCE_CYCLES = 30_000_000  # stands in for the amax all-reduce over the data-parallel group


class FP8Meta:
    """Global delayed-scaling buffers, one column per FP8 GEMM input (TE layout: [history, num_tensors])."""

    def __init__(self, num_tensors):
        self.amax_history = torch.ones(HIST_LEN, num_tensors, device=DEV)
        self.scale = torch.ones(num_tensors, device=DEV)

    def reset(self):
        self.amax_history.fill_(1.0)
        self.scale.fill_(1.0)


def amax_and_scale_update(meta, margin=0):
    """Eager part of reduce_and_update_fp8_tensors (amax_compute_algo='max')."""
    amax = meta.amax_history.amax(dim=0)
    meta.scale.copy_(FP8_MAX / amax / (2 ** margin))
    meta.amax_history.copy_(torch.roll(meta.amax_history, -1, 0))
    meta.amax_history[0].zero_()


class FP8LinearStack(torch.nn.Module):
    def __init__(self, weights, meta):
        super().__init__()
        self.weights = weights
        self.meta = meta

    def forward(self, x):
        for i, w in enumerate(self.weights):
            scale = self.meta.scale[i]
            self.meta.amax_history[0, i].copy_(x.abs().amax())  # TE's cast kernel records amax in history[0]
            x_fp8 = (x * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            x = torch.nn.functional.gelu((x_fp8.float() / scale) @ w.t())
        return x


def main():
    torch.manual_seed(0)
    weights = [torch.randn(HIDDEN, HIDDEN, device=DEV) / HIDDEN ** 0.5 for _ in range(N_LAYERS)]
    meta = FP8Meta(N_LAYERS)
    model = FP8LinearStack(weights, meta)
    inputs = torch.randn(STEPS, TOKENS, HIDDEN, device=DEV) * torch.tensor(MAGS, device=DEV)[:, None, None]
    outs = torch.empty(STEPS, TOKENS, HIDDEN, device=DEV)

    # capture the FP8 forward on a side stream (warm-up first, as make_graphed_callables does)
    graph_stream = torch.cuda.Stream()
    static_x = torch.zeros(TOKENS, HIDDEN, device=DEV)
    graph_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(graph_stream):
        for _ in range(2):
            model(static_x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=graph_stream):
        static_out = model(static_x)
    torch.cuda.synchronize()
    meta.reset()
    graph_stream.wait_stream(torch.cuda.current_stream())  # inputs, outs and reset meta are ready

    for step in range(STEPS):
        with torch.cuda.stream(graph_stream):
            static_x.copy_(inputs[step])
            graph.replay()
            outs[step].copy_(static_out)
        # delayed scaling: fold this step's amax into the history and compute next step's scale
        torch.cuda.current_stream().wait_stream(graph_stream)
        torch.cuda._sleep(ALLREDUCE_CYCLES)
        amax_and_scale_update(meta)
    torch.cuda.synchronize()

    # reference: the same recipe, eager, on one stream
    ref_meta = FP8Meta(N_LAYERS)
    ref_model = FP8LinearStack(weights, ref_meta)
    ref = torch.empty_like(outs)
    for step in range(STEPS):
        ref[step] = ref_model(inputs[step])
        amax_and_scale_update(ref_meta)
    torch.cuda.synchronize()
    rel = ((outs - ref).norm() / ref.norm()).item()
    print(f"rel_err={rel:.3e} scale={meta.scale.tolist()} ref_scale={ref_meta.scale.tolist()}")
    print(f"match={rel < 1e-3 and torch.allclose(meta.scale, ref_meta.scale)}")


if __name__ == "__main__":
    main()
