# Source: PyTorch docs docs/source/notes/cuda.rst, "CUDA Graphs / Whole-network capture": warm up in a side stream
#         (s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream()); with torch.cuda.stream(s): 3 x
#         [zero_grad, forward, backward, optimizer.step()]; torch.cuda.current_stream().wait_stream(s)), then
#         capture and replay with static_input.copy_(data). Same warm-up in DeepSpeed
#         deepspeed/inference/engine.py InferenceEngine._create_cuda_graph(), where the first call's input
#         tensors become self.static_inputs.
# Bug: the warm-up side stream does not wait for the current stream. The first batch (which becomes the static
#      input) is still being copied host->device on the default stream behind earlier work, and the three
#      warm-up training steps on the side stream read it before the copy landed: default-stream write vs
#      side-stream read of the static input tensor with no ordering. The warm-up SGD steps train on garbage,
#      so the weights differ from an eager run for the rest of training.
# Fix: s.wait_stream(torch.cuda.current_stream()) before the warm-up, as in the docs.
import copy

import torch

DEVICE = torch.device("cuda:0")
SLEEP_CYCLES = 30_000_000  # ~15 ms on an H200
DIM, HIDDEN, BATCH, STEPS, WARMUP, LR, SIGMA = 64, 256, 512, 6, 3, 0.05, 0.5


class ScoreNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.SiLU(),
                                       torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.SiLU(),
                                       torch.nn.Linear(HIDDEN, DIM))

    def forward(self, x):
        return self.net(x)


class GraphedTrainer:
    def __init__(self, model, noise):
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        self.noise = noise  # fixed noise bank, so graph and eager runs see the same noise

    def loss_fn(self, x):
        # denoising score matching: predict -eps / sigma from x + sigma * eps
        noisy = x + SIGMA * self.noise
        return ((self.model(noisy) * SIGMA + self.noise) ** 2).mean()

    def train_step_eager(self, x):
        self.optimizer.zero_grad(set_to_none=True)
        self.loss_fn(x).backward()
        self.optimizer.step()

    def create_cuda_graph(self, static_x):
        self.static_x = static_x
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())  # FIX: warm-up must see the producer's writes
        with torch.cuda.stream(s):
            for _ in range(WARMUP):
                self.train_step_eager(self.static_x)
        torch.cuda.current_stream().wait_stream(s)

        self.graph = torch.cuda.CUDAGraph()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(self.graph):
            self.static_loss = self.loss_fn(self.static_x)
            self.static_loss.backward()
            self.optimizer.step()

    def graph_step(self, x):
        self.static_x.copy_(x)
        self.graph.replay()


def main():
    torch.manual_seed(0)
    model = ScoreNet().to(DEVICE)
    ref_model = copy.deepcopy(model)
    noise = torch.randn(BATCH, DIM, device=DEVICE)
    host_batches = [torch.randn(BATCH, DIM).pin_memory() for _ in range(STEPS)]
    torch.cuda.synchronize()

    trainer = GraphedTrainer(model, noise)
    torch.cuda._sleep(SLEEP_CYCLES)  # the default stream is still busy with earlier work (metrics, logging)
    first = host_batches[0].to(DEVICE, non_blocking=True)
    trainer.create_cuda_graph(first)  # warm-up + capture on the first batch
    for hb in host_batches:
        trainer.graph_step(hb.to(DEVICE, non_blocking=True))
    torch.cuda.synchronize()

    ref = GraphedTrainer(ref_model, noise)  # eager reference, default stream only
    x0 = host_batches[0].to(DEVICE)
    for _ in range(WARMUP):
        ref.train_step_eager(x0)
    for hb in host_batches:
        ref.train_step_eager(hb.to(DEVICE))
    torch.cuda.synchronize()

    pairs = list(zip(model.parameters(), ref_model.parameters()))
    diff = torch.stack([(p - q).abs().max() for p, q in pairs]).max().item()
    ok = all(torch.allclose(p, q, atol=1e-4, rtol=1e-4) for p, q in pairs)
    print(f"max_param_diff={diff:.3e} match={ok}")


if __name__ == "__main__":
    main()
