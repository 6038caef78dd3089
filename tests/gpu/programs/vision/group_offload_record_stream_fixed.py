# Case: diffusers group offloading with use_stream=True, record_stream=True.
# Source: huggingface/diffusers src/diffusers/hooks/group_offloading.py, bug reported in
#   issue #12673 ("QwenImagepipeline incompatible with group offloading with record_stream=True")
#   and fixed by PR #12721: `_transfer_tensor_to_device` called current_stream() while inside
#   `with torch.cuda.stream(self.stream)`, so record_stream() recorded the *transfer* stream
#   (a no-op: it is the allocation stream) instead of the default stream that runs the forward.
#   offload_() skips its synchronize() when record_stream=True, so the freed on-device weights go
#   straight back to the transfer stream's pool and the next prefetch overwrites them while the
#   default stream may still be reading them.
# FIXED version: record_stream(default_stream) (the caching allocator records its event on the
# default stream when the weight is freed in offload_, so the block is reused only afterwards).
# Re-created here without diffusers (hook logic follows the block_level/leaf prefetch path).
import torch
import torch.nn as nn
import torch.nn.functional as F


class ModuleGroup:
    def __init__(self, modules, onload_device, stream, record_stream, onload_self):
        self.modules = modules
        self.onload_device = onload_device
        self.stream = stream
        self.record_stream = record_stream
        self.onload_self = onload_self
        # pinned CPU copies, as diffusers' _init_cpu_param_dict (low_cpu_mem_usage=False)
        self.cpu_param_dict = {}
        for m in self.modules:
            for p in m.parameters():
                self.cpu_param_dict[p] = p.data.cpu().pin_memory()

    def _transfer_tensor_to_device(self, tensor, source_tensor, default_stream=None):
        tensor.data = source_tensor.to(self.onload_device, non_blocking=True)
        if self.record_stream:
            # FIX (PR #12721): record the stream captured *before* entering the transfer-stream
            # context, i.e. the default stream that will run the forward pass
            tensor.data.record_stream(default_stream)

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
                p.data = self.cpu_param_dict[p]  # drops the last reference to the GPU copy


class GroupOffloadingHook:
    def __init__(self, group, next_group=None):
        self.group = group
        self.next_group = next_group

    def pre_forward(self, module, args):
        if self.group.onload_self:
            self.group.onload_()
        should_onload_next_group = self.next_group is not None and not self.next_group.onload_self
        if should_onload_next_group:
            self.next_group.onload_()  # prefetch on the transfer stream
        should_synchronize = (not self.group.onload_self and self.group.stream is not None
                              and not should_onload_next_group)
        if should_synchronize:
            self.group.stream.synchronize()
        return None

    def post_forward(self, module, args, output):
        self.group.offload_()
        return output


def apply_group_offloading(blocks, device, record_stream=True):
    stream = torch.cuda.Stream()
    groups = [ModuleGroup([b], device, stream, record_stream, onload_self=(i == 0))
              for i, b in enumerate(blocks)]
    for i, (b, g) in enumerate(zip(blocks, groups)):
        hook = GroupOffloadingHook(g, groups[i + 1] if i + 1 < len(groups) else None)
        b.register_forward_pre_hook(hook.pre_forward)
        b.register_forward_hook(hook.post_forward)
        g.offload_()
    return groups


class TransformerBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff1 = nn.Linear(dim, 4 * dim)
        self.ff2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, 8, d // 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(a)
        return x + self.ff2(F.gelu(self.ff1(self.norm2(x))))


class TinyDiT(nn.Module):
    def __init__(self, dim=512, depth=6, in_ch=4, patch=2):
        super().__init__()
        self.patch = patch
        self.proj_in = nn.Linear(in_ch * patch * patch, dim)
        self.blocks = nn.ModuleList([TransformerBlock(dim) for _ in range(depth)])
        self.proj_out = nn.Linear(dim, in_ch * patch * patch)

    def forward(self, latents):
        b, c, h, w = latents.shape
        p = self.patch
        x = latents.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
        x = self.proj_in(x)
        for blk in self.blocks:
            x = blk(x)
        x = self.proj_out(x)
        return x.view(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    model = TinyDiT()
    model.proj_in.to(device)
    model.proj_out.to(device)
    apply_group_offloading(list(model.blocks), device, record_stream=True)
    latents = torch.randn(2, 4, 32, 32, generator=torch.Generator().manual_seed(0)).to(device)
    sigmas = torch.linspace(1.0, 0.0, 5).tolist()
    for i in range(4):  # flow-matching Euler steps
        v = model(latents)
        latents = latents + (sigmas[i + 1] - sigmas[i]) * v
    torch.cuda.synchronize()
    print("latents mean", latents.float().mean().item())


if __name__ == "__main__":
    main()
