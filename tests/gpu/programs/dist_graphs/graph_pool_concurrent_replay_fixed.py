"""graph_pool_concurrent_replay -- FIXED version.

Source: PyTorch CUDA-graph docs, "Graph memory management / Sharing memory across
captures" and pytorch/pytorch PR #166975 (galv): sharing one pool (graph_pool_handle)
between graphs is safe only if the graphs never run concurrently.  Here two
independent per-modality feature heads are captured into ONE shared pool (the second
capture reuses the blocks the first capture freed for its intermediates) and are then
replayed concurrently on two side streams to overlap them.  The intermediates of the
two graphs live at the same addresses, and nothing orders the two replays.
The heads use only LayerNorm / elementwise / softmax kernels (no cuBLAS workspace).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class FeatureHead(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.scale = nn.Parameter(torch.rand(dim) + 0.5)
        self.shift = nn.Parameter(torch.randn(dim) * 0.1)

    def forward(self, x):
        h = self.norm(x)
        h = F.gelu(h * self.scale + self.shift)
        h = torch.tanh(h) * h
        return h.softmax(dim=-1)


def capture_heads(heads, static_inputs, pool):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            for head, x in zip(heads, static_inputs):
                head(x)
    torch.cuda.current_stream().wait_stream(side)

    graphs, outputs = [], []
    for head, x in zip(heads, static_inputs):
        g = torch.cuda.CUDAGraph()
        # FIX: heads that replay concurrently each get a private pool (no shared bytes)
        with torch.no_grad(), torch.cuda.graph(g):
            outputs.append(head(x))
        graphs.append(g)
    return graphs, outputs


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    batch, dim, steps = 512, 1024, 6
    heads = [FeatureHead(dim).to(dev).eval() for _ in range(2)]
    static_inputs = [torch.zeros(batch, dim, device=dev) for _ in range(2)]
    pool = torch.cuda.graph_pool_handle()
    graphs, static_outputs = capture_heads(heads, static_inputs, pool)

    audio = [torch.randn(batch, dim, device=dev) for _ in range(steps)]
    image = [torch.randn(batch, dim, device=dev) for _ in range(steps)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    fused = torch.empty(steps, batch, dim, device=dev)
    main_stream = torch.cuda.current_stream()
    for step in range(steps):
        static_inputs[0].copy_(audio[step])
        static_inputs[1].copy_(image[step])
        for g, s in zip(graphs, streams):
            s.wait_stream(main_stream)
            with torch.cuda.stream(s):
                g.replay()                  # both heads run concurrently
        for s in streams:
            main_stream.wait_stream(s)
        torch.add(static_outputs[0], static_outputs[1], out=fused[step])

    torch.cuda.synchronize()
    print("fused checksum:", float(fused.sum()))


if __name__ == "__main__":
    main()
