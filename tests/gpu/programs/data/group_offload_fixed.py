# Case group_offload (FIXED version)
# Modeled on huggingface/diffusers src/diffusers/hooks/group_offloading.py; fix as in
# huggingface/diffusers PR #12721 (fixes #12673): the compute stream is captured before
# entering `with torch.cuda.stream(self.stream)` and passed down, so record_stream()
# marks the onloaded weights as used by the compute stream. The caching allocator then
# defers reusing the block until an event recorded on the compute stream at free time
# has completed, so the next group's onload cannot overwrite weights still being read.
import torch
import torch.nn as nn
import torch.nn.functional as F


class ModuleGroup:
    def __init__(self, modules, onload_device, stream, record_stream=True, onload_self=True):
        self.modules = modules
        self.onload_device = onload_device
        self.stream = stream
        self.record_stream = record_stream
        self.onload_self = onload_self
        self.cpu_param_dict = {}
        for m in self.modules:
            for p in m.parameters():
                self.cpu_param_dict[p] = p.data.cpu().pin_memory()

    def _transfer_tensor_to_device(self, tensor, source_tensor, default_stream):
        tensor.data = source_tensor.to(self.onload_device, non_blocking=True)
        if self.record_stream:
            tensor.data.record_stream(default_stream)  # FIX: the compute stream

    def onload_(self):
        # Wait for previous Host->Device transfer to complete
        self.stream.synchronize()
        default_stream = torch.cuda.current_stream()
        with torch.cuda.stream(self.stream):
            for m in self.modules:
                for p in m.parameters():
                    self._transfer_tensor_to_device(p, self.cpu_param_dict[p], default_stream)

    def offload_(self):
        if not self.record_stream:
            torch.cuda.current_stream().synchronize()
        for m in self.modules:
            for p in m.parameters():
                p.data = self.cpu_param_dict[p]


class GroupOffloadingHook:
    def __init__(self, group, next_group=None):
        self.group = group
        self.next_group = next_group

    def pre_forward(self, module, args):
        if self.group.onload_self:
            self.group.onload_()
        should_onload_next_group = self.next_group is not None and not self.next_group.onload_self
        if should_onload_next_group:
            self.next_group.onload_()  # starts with stream.synchronize(): covers this group
        if not self.group.onload_self and not should_onload_next_group:
            self.group.stream.synchronize()  # last group: nothing else waits for its copy
        return tuple(a.to(self.group.onload_device, non_blocking=True) for a in args)

    def post_forward(self, module, args, output):
        self.group.offload_()
        return output


def apply_group_offloading(blocks, onload_device, record_stream=True):
    stream = torch.cuda.Stream()
    groups = [ModuleGroup([b], onload_device, stream, record_stream, onload_self=(i == 0))
              for i, b in enumerate(blocks)]
    for i, (block, group) in enumerate(zip(blocks, groups)):
        group.offload_()
        hook = GroupOffloadingHook(group, groups[i + 1] if i + 1 < len(groups) else None)
        block.register_forward_pre_hook(hook.pre_forward)
        block.register_forward_hook(hook.post_forward)
    return groups


class Block(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class TinyDenoiser(nn.Module):
    def __init__(self, dim=1024, hidden=4096, depth=6):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, hidden) for _ in range(depth)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@torch.no_grad()
def main():
    torch.manual_seed(0)
    device = torch.device('cuda', 0)
    model = TinyDenoiser()  # weights stay in pinned CPU memory between uses
    apply_group_offloading(model.blocks, device, record_stream=True)
    g = torch.Generator(device=device).manual_seed(0)
    latents = torch.randn(256, 1024, device=device, generator=g)
    for t in range(4):  # "denoising" steps
        eps = model(latents)
        latents = latents - 0.1 * eps / eps.norm(dim=1, keepdim=True)
    print('latent norm', latents.norm().item())


if __name__ == '__main__':
    main()
