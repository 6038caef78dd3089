# Source: diffusers, src/diffusers/hooks/group_offloading.py, group offloading
#   with use_stream=True, record_stream=True.  huggingface/diffusers issue
#   #12673 ("QwenImagepipeline incompatible with group offloading with
#   record_stream=True": garbage images) fixed by PR #12721: "The
#   current_stream() call inside _transfer_tensor_to_device is under
#   `with torch.cuda.stream(self.stream)`. So it is not returning the correct
#   default stream to call record_stream on!"
# Race (bug version): onloaded weights are allocated on the transfer stream
#   and read by the block's forward on the default (compute) stream.  The code
#   means to call record_stream(<compute stream>), but it queries
#   torch.cuda.current_stream() inside the transfer-stream context, so it
#   records the transfer stream itself (a no-op).  offload_() then drops the
#   GPU weights while the block's kernels on the compute stream are still
#   queued; the caching allocator immediately gives the block to the next
#   prefetch on the transfer stream, whose H2D overwrites the weights before
#   the pending Linear reads them.  (missing record_stream in effect)
# Fix: query the compute stream before entering the transfer-stream context.
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

SPIN = 20_000_000  # torch.cuda._sleep cycles (~10 ms on H200)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        torch.cuda._sleep(SPIN)  # stands in for attention kernels ahead of the projection
        return x + F.gelu(self.proj(x))


class ModuleGroup:
    def __init__(self, module, stream):
        self.module = module
        self.stream = stream
        self.onloaded = False
        self.onload_event = torch.cuda.Event()
        self.cpu_param_dict = {}
        for p in module.parameters():
            self.cpu_param_dict[p] = p.data.cpu().pin_memory()
            p.data = self.cpu_param_dict[p]

    def _transfer_tensor_to_device(self, tensor, source_tensor, current_stream):
        tensor.data = source_tensor.to("cuda", non_blocking=True)
        tensor.data.record_stream(current_stream)

    def onload_(self):
        with torch.cuda.stream(self.stream):
            current_stream = torch.cuda.current_stream()  # returns self.stream here
            for p, cpu in self.cpu_param_dict.items():
                self._transfer_tensor_to_device(p, cpu, current_stream)
            self.onload_event.record(self.stream)
        self.onloaded = True

    def offload_(self):
        for p, cpu in self.cpu_param_dict.items():
            p.data = cpu  # drops the GPU copy; relies on record_stream
        self.onloaded = False


class GroupOffloadingHook:
    def __init__(self, group, next_group):
        self.group = group
        self.next_group = next_group

    def pre_forward(self, module, args):
        if not self.group.onloaded:
            self.group.onload_()
        if self.next_group is not None:
            self.next_group.onload_()  # prefetch the next block's weights
        torch.cuda.current_stream().wait_event(self.group.onload_event)
        return args

    def post_forward(self, module, args, output):
        self.group.offload_()
        return output


def apply_group_offloading(blocks, stream):
    groups = [ModuleGroup(b, stream) for b in blocks]
    for i, g in enumerate(groups):
        hook = GroupOffloadingHook(g, groups[i + 1] if i + 1 < len(groups) else None)
        g.module.register_forward_pre_hook(hook.pre_forward)
        g.module.register_forward_hook(hook.post_forward)
    return groups


def main():
    torch.manual_seed(0)
    D, NBLOCKS, T, STEPS = 2048, 8, 1024, 4
    model = nn.Sequential(*[Block(D) for _ in range(NBLOCKS)])
    for p in model.parameters():
        p.data.mul_(0.5)
    latents = torch.randn(T, D)

    with torch.no_grad():
        ref_model = copy.deepcopy(model).cuda()
        ref = latents.cuda()
        for _ in range(STEPS):
            ref = ref_model(ref) * 0.5
        torch.cuda.synchronize()

        transfer_stream = torch.cuda.Stream()
        apply_group_offloading(list(model), transfer_stream)
        x = latents.cuda()
        for _ in range(STEPS):
            x = model(x) * 0.5
        torch.cuda.synchronize()

    checksum = x.double().sum().item()
    err = (x - ref).abs().max().item() / ref.abs().max().item()
    print(f"checksum={checksum:.8e} rel_err_vs_ref={err:.3e}",
          "OK" if err < 1e-5 else "MISMATCH")


if __name__ == "__main__":
    main()
