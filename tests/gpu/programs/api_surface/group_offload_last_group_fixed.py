# Source: huggingface/diffusers src/diffusers/hooks/group_offloading.py -- ModuleGroup._onload_from_memory /
#   ModuleGroup._offload_to_memory and GroupOffloadingHook.pre_forward, block_level offloading with use_stream=True,
#   record_stream=False (the group's stream is a device-generic torch.Stream, the accelerator module is taken from
#   torch.accelerator.current_accelerator()).  Modelled on the pre_forward before the `should_synchronize` branch
#   ("If this group didn't onload itself, it means it was asynchronously onloaded by the previous group. We need to
#   synchronize the side stream ... Without this, uninitialized weights will be used in the computation").
# Bug: every group but the first is prefetched by the previous group's hook: the H2D copies of its weights run on the
#   transfer stream (torch.Stream).  For groups 1..n-2 the prefetch of the *next* group starts with
#   self.stream.synchronize(), which incidentally waits for the current group's copies.  The last group has no next
#   group, so nothing orders its H2D weight copies (transfer stream, writes the freshly allocated device weights) before
#   its Linear (default stream, reads the weights): device-device race on the last block's weight/bias tensors.
# Fix: pre_forward calls self.group.stream.synchronize() when the group was onloaded by its predecessor and no next
#   group is prefetched (the `should_synchronize` branch of the real hook): the host waits for the transfer stream
#   before it enqueues the last block's forward on the default stream.
import copy

import torch
import torch.nn as nn

SLOW_H2D_CYCLES = 30_000_000  # the PCIe link is shared with other traffic: the transfer stream starts late


class ModuleGroup:
    def __init__(self, modules, onload_device, stream=None, record_stream=False, onload_self=True):
        self.modules = modules
        self.onload_device = onload_device
        self.stream = stream
        self.record_stream = record_stream
        self.onload_self = onload_self
        self.non_blocking = stream is not None
        self._torch_accelerator_module = getattr(torch, torch.accelerator.current_accelerator().type)
        self.cpu_param_dict = {p: p.data.cpu().pin_memory() for m in modules for p in m.parameters()}

    def onload_(self):
        if self.stream is not None:
            # Wait for previous Host->Device transfer to complete
            self.stream.synchronize()
        with self._torch_accelerator_module.stream(self.stream):
            torch.cuda._sleep(SLOW_H2D_CYCLES)
            for module in self.modules:
                for param in module.parameters():
                    param.data = self.cpu_param_dict[param].to(self.onload_device, non_blocking=self.non_blocking)
                    if self.record_stream:
                        param.data.record_stream(self._torch_accelerator_module.current_stream())

    def offload_(self):
        if self.stream is not None and not self.record_stream:
            self._torch_accelerator_module.current_stream().synchronize()
        for module in self.modules:
            for param in module.parameters():
                param.data = self.cpu_param_dict[param]


class GroupOffloadingHook:
    def __init__(self, group):
        self.group = group
        self.next_group = None

    def pre_forward(self, module, args):
        if self.group.onload_self:
            self.group.onload_()
        should_onload_next_group = self.next_group is not None and not self.next_group.onload_self
        if should_onload_next_group:
            self.next_group.onload_()
        should_synchronize = (
            not self.group.onload_self
            and self.group.stream is not None
            and not should_onload_next_group
            and not self.group.record_stream
        )
        if should_synchronize:
            # This group was onloaded asynchronously by the previous group and no next-group prefetch will
            # synchronize the stream for us: wait for its H2D copies before the forward reads the weights.
            self.group.stream.synchronize()
        return args

    def post_forward(self, module, args, output):
        self.group.offload_()
        return output


def apply_group_offloading(blocks, onload_device):
    stream = torch.Stream(device=onload_device)
    hooks = []
    for i, block in enumerate(blocks):
        group = ModuleGroup([block], onload_device, stream=stream, onload_self=(i == 0))
        hook = GroupOffloadingHook(group)
        group.offload_()  # initialize_hook: the offload leader starts on the offload device
        block.register_forward_pre_hook(hook.pre_forward)
        block.register_forward_hook(hook.post_forward)
        hooks.append(hook)
    for hook, nxt in zip(hooks[:-1], hooks[1:]):
        hook.next_group = nxt.group  # prefetch chain: group i onloads group i+1
    return hooks


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.act(self.proj(x))


class Transformer2DModelStub(nn.Module):
    def __init__(self, dim=1024, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, hidden_states):
        for block in self.blocks:
            hidden_states = block(hidden_states)
        return hidden_states


def main():
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    model = Transformer2DModelStub()
    reference_model = copy.deepcopy(model).to(device)
    latents = torch.randn(64, 1024, device=device)

    with torch.no_grad():
        expected = latents
        for _ in range(2):  # two denoising steps
            expected = reference_model(expected) * 0.5
    torch.cuda.synchronize(device)

    apply_group_offloading(model.blocks, device)
    with torch.no_grad():
        out = latents
        for _ in range(2):
            out = model(out) * 0.5
    torch.accelerator.synchronize()

    diff = (out - expected).abs().max().item()
    print(f"max|diff|={diff:.3g}")
    print(f"match={torch.allclose(out, expected, atol=1e-4, rtol=1e-4)}")


if __name__ == "__main__":
    main()
