# Source: vllm vllm/v1/worker/gpu_ubatch_wrapper.py (UBatchWrapper: dual-batch overlap, micro-batches run on
#         separate streams, graphs captured with pool=current_platform.get_global_graph_pool()) and
#         vllm/compilation/cuda_graph.py (CUDAGraphWrapper shares the global graph pool across captures).
#         PyTorch test/test_cuda.py test_graph_concurrent_replay documents the hazard: graphs that share a
#         memory pool may be replayed in capture order on one stream, never concurrently.
# Bug: each micro-batch gets its own CUDA graph, captured one after the other into the same shared pool, so the
#      second capture's intermediates are carved from the blocks the first capture freed (its `h` activations).
#      The runner then replays ubatch 0 on stream 0 and ubatch 1 on stream 1 concurrently: graph 1 writes its
#      intermediates into the block graph 0 still reads after its attention stand-in kernel. Stream-0 read vs
#      stream-1 write of one pool block that was handed to a second capture (allocation reuse), with no
#      ordering between the two replays.
# Fix: capture every micro-batch graph into a private pool (pool=torch.cuda.graph_pool_handle() per capture),
#      so the concurrent replays touch disjoint memory.
import torch

DEVICE = torch.device("cuda:0")
ATTN_CYCLES = 20_000_000  # ~10 ms on an H200: stand-in for the attention kernel of each layer
DIM, UBATCH_TOKENS, NUM_LAYERS = 1024, 512, 3


def layer_forward(x, norm_weight, gate):
    # RMSNorm -> gated activation -> (attention) -> residual; elementwise only, so no cuBLAS workspace
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
    h = torch.nn.functional.silu(h * gate)
    torch.cuda._sleep(ATTN_CYCLES)
    return x + h


def model_forward(x, layers):
    for norm_weight, gate in layers:
        x = layer_forward(x, norm_weight, gate)
    return x


class UBatchGraphRunner:
    def __init__(self, layers, num_ubatches=2):
        self.layers = layers
        self.graph_pool = torch.cuda.graph_pool_handle()  # current_platform.get_global_graph_pool()
        self.streams = [torch.cuda.Stream() for _ in range(num_ubatches)]
        self.static_inputs = [torch.zeros(UBATCH_TOKENS, DIM, device=DEVICE) for _ in range(num_ubatches)]
        self.graphs, self.static_outputs = [], []

    def capture(self):
        for static_in in self.static_inputs:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):  # BUG: one pool shared by all ubatch graphs
                self.static_outputs.append(model_forward(static_in, self.layers))
            self.graphs.append(graph)
        torch.cuda.synchronize()

    def run(self, hidden_states):
        main = torch.cuda.current_stream()
        for static_in, chunk in zip(self.static_inputs, hidden_states.chunk(len(self.graphs))):
            static_in.copy_(chunk)
        for stream, graph in zip(self.streams, self.graphs):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                graph.replay()
        for stream in self.streams:
            main.wait_stream(stream)
        return torch.cat(self.static_outputs)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    layers = [(1 + 0.1 * torch.randn(DIM, device=DEVICE), torch.randn(DIM, device=DEVICE))
              for _ in range(NUM_LAYERS)]
    runner = UBatchGraphRunner(layers)
    runner.capture()

    x = torch.cat([torch.randn(UBATCH_TOKENS, DIM, device=DEVICE),
                   torch.randn(UBATCH_TOKENS, DIM, device=DEVICE) * 4 + 2])
    out = runner.run(x)
    torch.cuda.synchronize()

    ref = torch.cat([model_forward(c, layers) for c in x.chunk(2)])
    torch.cuda.synchronize()
    print(f"max_abs_diff={(out - ref).abs().max().item():.3e} match={torch.allclose(out, ref, atol=1e-3, rtol=1e-3)}")


if __name__ == "__main__":
    main()
