# Source: SGLang speculative decoding CUDA graphs: python/sglang/srt/model_executor/cuda_graph_runner.py
#   (CudaGraphRunner.capture: `with torch.cuda.graph(graph, pool=get_global_graph_memory_pool(), stream=...)`, then
#   set_global_graph_memory_pool(graph.pool())) and python/sglang/srt/speculative/eagle_draft_cuda_graph_runner.py
#   (EAGLEDraftCudaGraphRunner captures into the same global pool). vLLM's CUDAGraphWrapper shares one pool the same
#   way. PyTorch's torch.cuda.graph docs: sharing a pool is only safe if the graphs never run concurrently.
# Bug: the target graph is captured first; its temporary `t = sin(x)` is freed during capture, so the draft graph,
#   captured next into the same private pool, is handed that block for its output `draft_out`. At serve time the
#   draft graph is replayed on draft_stream to overlap with the target replay on target_stream, with no edge between
#   the two replays: the target replay's write+read of its temporary and the draft replay's write of draft_out hit the
#   same bytes unordered (target_stream vs draft_stream). With the target stream running late, the target's
#   temporary overwrites draft_out before the default stream reads it.
# Fix: the draft replay waits for the target replay (draft_stream.wait_stream(target_stream)) before it runs, the
#   ordering under which graphs sharing one pool may reuse each other's temporaries.
import torch

N = 1 << 20                     # 4 MiB fp32 activations
STEPS = 4
TARGET_DELAY = 40_000_000       # cycles: the (bigger) target model runs longer than the draft model

_global_graph_memory_pool = None


def get_global_graph_memory_pool():
    return _global_graph_memory_pool


def set_global_graph_memory_pool(pool):
    global _global_graph_memory_pool
    _global_graph_memory_pool = pool


def target_forward(x):
    t = torch.sin(x)            # temporary: freed inside the capture, its block stays in the graph pool
    return torch.cos(t) * 0.5 + 0.25


def draft_forward(x):
    return torch.tanh(x)


class GraphRunner:
    def __init__(self, forward, static_input):
        self.graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):                       # warm-up outside the capture (as SGLang does)
            for _ in range(2):
                forward(static_input)
        torch.cuda.current_stream().wait_stream(s)
        pool = get_global_graph_memory_pool()
        if pool is None:
            pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = forward(static_input)
        set_global_graph_memory_pool(self.graph.pool())

    def replay(self):
        self.graph.replay()
        return self.output


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    static_x = torch.zeros(N, device=dev)
    target = GraphRunner(target_forward, static_x)
    draft = GraphRunner(draft_forward, static_x)
    target_stream, draft_stream = torch.cuda.Stream(), torch.cuda.Stream()
    inputs = [torch.randn(N, device=dev) for _ in range(STEPS)]
    torch.cuda.synchronize()

    results = []
    main_stream = torch.cuda.current_stream()
    for x in inputs:
        static_x.copy_(x)
        target_stream.wait_stream(main_stream)
        draft_stream.wait_stream(main_stream)
        with torch.cuda.stream(target_stream):           # verify step of the target model
            torch.cuda._sleep(TARGET_DELAY)
            target_out = target.replay()
        with torch.cuda.stream(draft_stream):            # next draft step, overlapped with the target
            draft_out = draft.replay()
        main_stream.wait_stream(target_stream)
        main_stream.wait_stream(draft_stream)
        results.append((target_out.clone(), draft_out.clone()))
    torch.cuda.synchronize()

    ok = True
    for x, (t_out, d_out) in zip(inputs, results):
        ok = ok and torch.allclose(t_out, target_forward(x), atol=1e-5)
        ok = ok and torch.allclose(d_out, draft_forward(x), atol=1e-5)
    print(f"match={ok}")


if __name__ == "__main__":
    main()
