# NVIDIA NeMo EMAOptimizer: EMA of the weights updated on a side CUDA stream (FIXED version).
# Source: NVIDIA/NeMo nemo/collections/common/callbacks/ema.py (EMAOptimizer): update() makes
#   self.stream wait for the current stream and runs torch._foreach_mul_/_foreach_add_ over
#   (ema_params, params) on self.stream; step() starts with self.join(), which calls
#   self.stream.synchronize(), before the wrapped optimizer writes the parameters again.
#   This version keeps the join() at the top of step(), as in NeMo.
import contextlib
import copy

import torch
import torch.nn as nn

DEV = torch.device("cuda:0")


@torch.no_grad()
def ema_update(ema_model_tuple, current_model_tuple, decay):
    torch._foreach_mul_(ema_model_tuple, decay)
    torch._foreach_add_(ema_model_tuple, current_model_tuple, alpha=(1.0 - decay))


class EMAOptimizer:
    def __init__(self, optimizer, device, decay=0.999, every_n_steps=1, current_step=0):
        self.optimizer = optimizer
        self.decay = decay
        self.device = device
        self.current_step = current_step
        self.every_n_steps = every_n_steps
        self.first_iteration = True
        self.rebuild_ema_params = True
        self.stream = None
        self.ema_params = ()

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def all_parameters(self):
        return (param for group in self.param_groups for param in group["params"])

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        self.join()
        if self.first_iteration:
            if any(p.is_cuda for p in self.all_parameters()):
                self.stream = torch.cuda.Stream()
            self.first_iteration = False
        if self.rebuild_ema_params:
            opt_params = list(self.all_parameters())
            self.ema_params += tuple(
                copy.deepcopy(param.data.detach()).to(self.device) for param in opt_params[len(self.ema_params):])
            self.rebuild_ema_params = False
        loss = self.optimizer.step(closure)
        if self.current_step % self.every_n_steps == 0:
            self.update()
        self.current_step += 1
        return loss

    @torch.no_grad()
    def update(self):
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            current_model_state = tuple(
                param.data.to(self.device, non_blocking=True) for param in self.all_parameters())
            ema_update(self.ema_params, current_model_state, self.decay)

    def join(self):
        if self.stream is not None:
            self.stream.synchronize()

    @contextlib.contextmanager
    def swap_ema_weights(self):
        self.join()
        for param, ema_param in zip(self.all_parameters(), self.ema_params):
            tmp = torch.empty_like(param.data)
            tmp.copy_(param.data)
            param.data.copy_(ema_param)
            ema_param.copy_(tmp)
        try:
            yield
        finally:
            for param, ema_param in zip(self.all_parameters(), self.ema_params):
                tmp = torch.empty_like(param.data)
                tmp.copy_(param.data)
                param.data.copy_(ema_param)
                ema_param.copy_(tmp)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(32, 10)

    def forward(self, x):
        return self.classifier(self.features(x))


def main():
    torch.manual_seed(0)
    model = ConvNet().to(DEV)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = EMAOptimizer(base, device=DEV, decay=0.99)
    for step in range(6):
        x = torch.randn(32, 3, 32, 32, device=DEV)
        y = torch.randint(0, 10, (32,), device=DEV)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    # validation with the EMA weights (swap_ema_weights joins the EMA stream first)
    with optimizer.swap_ema_weights(), torch.no_grad():
        x = torch.randn(32, 3, 32, 32, device=DEV)
        ema_logits = model(x)
    torch.cuda.synchronize()
    print("ema logits mean", round(ema_logits.mean().item(), 6))


if __name__ == "__main__":
    main()
