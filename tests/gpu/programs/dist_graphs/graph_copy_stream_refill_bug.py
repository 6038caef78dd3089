"""graph_copy_stream_refill -- BUG version.

Pattern: inference engine that captures the model once (torch.cuda.graph on an explicit
side stream, after the documented side-stream warm-up) and refills the graph's static
input from pinned host batches on a dedicated H2D copy stream so uploads overlap compute.
Related real fix: flagos-ai/FlagTree PR #1129 ("Preserve caller-stream ordering in CUDA
graph benchmarks", issue #1127): graph work ran on a stream with no dependency on the
stream that prepared its inputs.  Here the copy stream correctly waits for the previous
replay (WAR), but the replay never waits for the copy stream (RAW) -> the graph may read
static_x while the H2D copy is still writing it.
"""
import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self, d_in=1024, d_hidden=2048, d_out=256):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(),
                                 nn.Linear(d_hidden, d_hidden), nn.GELU(),
                                 nn.Linear(d_hidden, d_out))

    def forward(self, x):
        return self.net(x)


class GraphedPredictor:
    def __init__(self, model, batch, d_in, device):
        self.static_x = torch.zeros(batch, d_in, device=device)
        self.capture_stream = torch.cuda.Stream()
        self.copy_stream = torch.cuda.Stream()
        self.graph = torch.cuda.CUDAGraph()
        # warm-up on the side stream (cuBLAS handles, autotuning) before capture
        self.capture_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.capture_stream), torch.no_grad():
            for _ in range(3):
                model(self.static_x)
        torch.cuda.current_stream().wait_stream(self.capture_stream)
        with torch.no_grad(), torch.cuda.graph(self.graph, stream=self.capture_stream):
            self.static_y = model(self.static_x)

    def stage(self, host_batch):
        """Upload the next batch into the static input on the copy stream."""
        # WAR: don't overwrite static_x while the previous replay may still read it
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            self.static_x.copy_(host_batch, non_blocking=True)

    def run(self):
        self.graph.replay()          # launched on the current (default) stream
        return self.static_y


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    batch, d_in, steps = 256, 1024, 8
    model = MLP(d_in).to(dev).eval()
    predictor = GraphedPredictor(model, batch, d_in, dev)

    host_batches = [torch.randn(batch, d_in).pin_memory() for _ in range(steps)]
    preds = torch.empty(steps, batch, dtype=torch.long, device=dev)
    for i in range(steps):
        predictor.stage(host_batches[i])
        y = predictor.run()
        preds[i].copy_(y.argmax(dim=-1))

    torch.cuda.synchronize()
    print("class histogram:", torch.bincount(preds.flatten(), minlength=256)[:8].tolist())


if __name__ == "__main__":
    main()
