# Case: image classifier captured in a CUDA graph (torch.cuda.graph), with the graph's static input
# refilled for the next batch by a separate copy stream so the H2D copy overlaps the replay.
# Source: capture/warm-up follows the "Whole-network capture" example of the PyTorch CUDA-graphs docs
#   (docs/source/notes/cuda.rst); the cross-stream reuse of static buffers and its fix (record an
#   event after each use and wait on it before the next call touches a static buffer) follow the
#   review of sgl-project/sglang-omni PR #1369 (bucketed CUDA graphs for the Fun-ASR encoder).
# FIXED: before refilling, the copy stream waits on `replay_done`, an event recorded on the default
#   stream right after the previous replay; replay i+1 still waits on `ready` from the copy stream.
import torch
import torch.nn as nn


class ConvBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                  nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return torch.relu(self.body(x) + self.short(x))


class Classifier(nn.Module):
    def __init__(self, num_classes=100):
        super().__init__()
        self.features = nn.Sequential(ConvBlock(3, 32, 2), ConvBlock(32, 64, 2), ConvBlock(64, 128, 2))
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3))).softmax(-1)


class GraphedRunner:
    def __init__(self, model, batch_shape):
        self.static_input = torch.zeros(batch_shape, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up on a side stream, as the docs require
            for _ in range(3):
                model(self.static_input)
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_output = model(self.static_input)
        self.replay_done = torch.cuda.Event()

    def replay(self):
        self.graph.replay()  # launched on the current stream
        self.replay_done.record()


class InputRefiller:
    """Copies the next host batch into the graph's static input on its own stream."""

    def __init__(self, runner):
        self.runner = runner
        self.stream = torch.cuda.Stream()
        self.ready = torch.cuda.Event()

    def refill(self, host_batch):
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.runner.replay_done)  # FIX: previous replay has read it
            self.runner.static_input.copy_(host_batch, non_blocking=True)
            self.runner.static_input.sub_(0.5).div_(0.25)
        self.ready.record(self.stream)

    def wait_ready(self):
        torch.cuda.current_stream().wait_event(self.ready)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = Classifier().cuda().eval()
    shape = (32, 3, 128, 128)
    g = torch.Generator().manual_seed(0)
    host_batches = [torch.rand(shape, generator=g).pin_memory() for _ in range(6)]
    runner = GraphedRunner(model, shape)
    refiller = InputRefiller(runner)
    outputs = []
    refiller.refill(host_batches[0])
    for i in range(len(host_batches)):
        refiller.wait_ready()          # replay i reads static_input only after refill i
        runner.replay()
        outputs.append(runner.static_output.argmax(-1))  # same stream as the replay
        if i + 1 < len(host_batches):
            refiller.refill(host_batches[i + 1])  # overlaps with replay i
    preds = torch.stack(outputs).cpu()
    print("predictions", preds.shape, preds.sum().item())


if __name__ == "__main__":
    main()
