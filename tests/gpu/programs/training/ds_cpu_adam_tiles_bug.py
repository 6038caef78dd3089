# DeepSpeed ZeRO-Offload DeepSpeedCPUAdam "step + copy" with a pinned double buffer (BUG version).
# Source: deepspeedai/DeepSpeed csrc/includes/cpu_adam.h, Adam_Optimizer::Step_1 / Step_AVX
#   (ds_adam_step_plus_copy): the CPU Adam update is done tile by tile; each updated tile is
#   written into _doubled_buffer[_buf_index] (pinned host memory) and launch_param_update()
#   copies it to the GPU parameters asynchronously on _streams[_buf_index]; before a buffer is
#   rewritten two tiles later the code calls cudaStreamSynchronize(_streams[_buf_index]) when
#   (t / TILE) >= 2, and SynchronizeStreams() at the end.  Related real report: DeepSpeed PR #3097
#   ("Disable Stage 1&2 CPUAdam pathways": the synchronize did not block Python until the copy
#   finished).  The bug injected here is an off-by-one in that guard (> instead of >=), a
#   plausible variant of the real pattern: tile 2 rewrites buffer 0 while the H2D copy of tile 0
#   may still be reading it.
import torch
import torch.nn as nn

DEV = torch.device("cuda:0")
TILE = 1 << 15


class DeepSpeedCPUAdamLite:
    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        self.params = list(model.parameters())
        numel = sum(p.numel() for p in self.params)
        # fp32 flat device params: the model parameters become views into it
        self.dev_params = torch.cat([p.detach().reshape(-1) for p in self.params])
        off = 0
        for p in self.params:
            p.data = self.dev_params[off:off + p.numel()].view_as(p)
            off += p.numel()
        self.fp32_master = self.dev_params.cpu()          # CPU master copy
        self.exp_avg = torch.zeros(numel)
        self.exp_avg_sq = torch.zeros(numel)
        self.cpu_grads = torch.empty(numel, pin_memory=True)
        self._doubled_buffer = [torch.empty(TILE, pin_memory=True) for _ in range(2)]
        self._streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        self._buf_index = 0
        self.lr, self.betas, self.eps, self.step_count = lr, betas, eps, 0

    def copy_grads_to_cpu(self):
        flat_grad = torch.cat([p.grad.reshape(-1) for p in self.params])
        self.cpu_grads.copy_(flat_grad, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    @torch.no_grad()
    def step_plus_copy(self):
        self.step_count += 1
        b1, b2 = self.betas
        bc1 = 1 - b1 ** self.step_count
        bc2 = (1 - b2 ** self.step_count) ** 0.5
        n = self.fp32_master.numel()
        for t in range(0, n, TILE):
            copy_size = min(TILE, n - t)
            if (t // TILE) > 2:
                self._streams[self._buf_index].synchronize()
            p = self.fp32_master[t:t + copy_size]
            g = self.cpu_grads[t:t + copy_size]
            m = self.exp_avg[t:t + copy_size]
            v = self.exp_avg_sq[t:t + copy_size]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            p.addcdiv_(m, v.sqrt().div_(bc2).add_(self.eps), value=-self.lr / bc1)
            buf = self._doubled_buffer[self._buf_index][:copy_size]
            buf.copy_(p)
            with torch.cuda.stream(self._streams[self._buf_index]):
                # launch_param_update(_doubled_buffer[_buf_index], dev_params + t, copy_size, stream)
                self.dev_params[t:t + copy_size].copy_(buf, non_blocking=True)
            self._buf_index = 1 - self._buf_index
        # SynchronizeStreams()
        for s in self._streams:
            s.synchronize()


class Net(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)
        self.fc3 = nn.Linear(d, 1)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def main():
    torch.manual_seed(0)
    model = Net().to(DEV)
    opt = DeepSpeedCPUAdamLite(model)   # 131,841 params -> 5 tiles
    losses = []
    for step in range(4):
        x = torch.randn(128, 256, device=DEV)
        y = torch.randn(128, 1, device=DEV)
        for p in model.parameters():
            p.grad = None
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.copy_grads_to_cpu()
        opt.step_plus_copy()
        losses.append(loss.item())
    print("losses", [round(v, 4) for v in losses])


if __name__ == "__main__":
    main()
