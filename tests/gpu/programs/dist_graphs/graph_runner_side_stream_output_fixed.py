"""graph_runner_side_stream_output -- FIXED version.

Source: XPU-Forces/xpu_graph PR #491 ("fix(device_graph_runner): ensure stream sync after
graph replay"): GraphRunner.forward replays the captured graph under
`with torch.cuda.stream(self._stream)` so that it runs on the runner's own stream; the
reviewers then discuss dropping the `self._stream.synchronize()` to keep forward
asynchronous.  Without any replacement edge, the caller consumes the static output on
its own (default) stream while the replay on the runner stream may still be writing it.
The runner stream does wait for the caller stream before refilling the static input.
"""
import torch
import torch.nn as nn


class Decoder(nn.Module):
    def __init__(self, d=1024, vocab=4096):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, h):
        h = h + self.ff(self.norm(h))
        return self.lm_head(h)


class GraphRunner:
    def __init__(self, module, sample):
        self._stream = torch.cuda.Stream()
        self._graph = torch.cuda.CUDAGraph()
        self._static_in = sample.clone()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream), torch.no_grad():
            for _ in range(3):
                module(self._static_in)
        torch.cuda.current_stream().wait_stream(self._stream)
        with torch.no_grad(), torch.cuda.graph(self._graph, stream=self._stream):
            self._static_out = module(self._static_in)

    def forward(self, x):
        # x was produced on the caller's stream
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            self._static_in.copy_(x)
            self._graph.replay()
        # FIX: order the caller stream after the replay before it touches the output
        torch.cuda.current_stream().wait_stream(self._stream)
        return self._static_out


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    batch, d, steps = 64, 1024, 8
    model = Decoder(d).to(dev).eval()
    hidden = [torch.randn(batch, d, device=dev) for _ in range(steps)]
    runner = GraphRunner(model, hidden[0])

    tokens = torch.empty(steps, batch, dtype=torch.long, device=dev)
    for step in range(steps):
        logits = runner.forward(hidden[step])
        tokens[step].copy_(logits.argmax(dim=-1))   # caller (default) stream reads output

    torch.cuda.synchronize()
    print("first tokens:", tokens[:, 0].tolist())


if __name__ == "__main__":
    main()
