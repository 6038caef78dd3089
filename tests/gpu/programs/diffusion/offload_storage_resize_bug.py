# Source: model CPU offload hooks as in huggingface/accelerate cpu_offload_with_hook and diffusers
#   DiffusionPipeline.enable_model_cpu_offload (a pre-forward hook onloads a component and offloads the
#   previously used one), implemented with two streams as in LightX2V's WeightAsyncStreamManager
#   (ModelTC/LightX2V: a load stream and a compute stream), and with FSDP/Megatron-style storage freeing
#   (param.untyped_storage().resize_(0), see the review discussion in areal-project/AReaL PR #1393 about
#   freeing storage that kernels may still use). The ordering rule is ComfyUI's comfy/ops.py
#   uncast_bias_weight(): offload_stream.wait_stream(current_stream) after the last use of onloaded weights,
#   so the offload stream cannot recycle that memory while the compute stream still reads it.
#
# Components (text encoder, UNet, VAE) run on compute_stream; their weights are materialized on load_stream
# (storage.resize_(nbytes) allocates from load_stream's pool, then an H2D copy), and compute_stream waits on
# an event. Offloading frees the storages in place with resize_(0) while the Parameter objects stay put.
#   offload_storage_resize_bug.py:   offload frees the storages with no ordering; the next component's onload
#                                    allocates on load_stream, gets the same blocks back and overwrites them
#                                    while compute_stream has not yet run the previous component's kernels.
#   offload_storage_resize_fixed.py: load_stream.wait_stream(compute_stream) before the storages are freed.
import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms spin on the compute stream at the start of every component forward
DIM = 1024
STEPS = 3
DEVICE = torch.device("cuda:0")


class Component(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM, bias=False)
        self.fc2 = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        torch.cuda._sleep(SLEEP_CYCLES)
        return torch.tanh(self.fc2(torch.tanh(self.fc1(x))))


class CpuOffloadHook:
    """Pre-forward hook: offload the previously used component, then onload this one."""

    def __init__(self, model, load_stream, compute_stream, prev_module_hook=None):
        self.model = model
        self.load_stream = load_stream
        self.compute_stream = compute_stream
        self.prev_module_hook = prev_module_hook
        self.cpu_state = {p: p.data.pin_memory() for p in model.parameters()}
        self.onloaded = False
        for p in model.parameters():
            p.data = torch.empty(p.shape, device=DEVICE)  # keep module.device == cuda ...
            p.data.untyped_storage().resize_(0)            # ... but hold no GPU memory while offloaded
        model.register_forward_pre_hook(self.pre_forward)

    def onload(self):
        with torch.cuda.stream(self.load_stream):
            for p, src in self.cpu_state.items():
                p.data.untyped_storage().resize_(src.numel() * src.element_size())
                p.data.copy_(src, non_blocking=True)
            loaded = torch.cuda.Event()
            loaded.record()
        self.compute_stream.wait_event(loaded)
        self.onloaded = True

    def offload(self):
        for p in self.model.parameters():
            p.data.untyped_storage().resize_(0)
        self.onloaded = False

    def pre_forward(self, module, args):
        if self.prev_module_hook is not None and self.prev_module_hook.onloaded:
            self.prev_module_hook.offload()
        if not self.onloaded:
            self.onload()
        return None


def run_pipeline(text_encoder, unet, vae, tokens, latents):
    prompt_embeds = text_encoder(tokens)
    for _ in range(STEPS):
        latents = latents + 0.1 * unet(latents + prompt_embeds)
    return vae(latents)


def main():
    torch.manual_seed(0)
    text_encoder, unet, vae = Component(), Component(), Component()
    tokens = torch.randn(64, DIM, device=DEVICE)
    latents = torch.randn(64, DIM, device=DEVICE)

    with torch.no_grad():
        ref = run_pipeline(text_encoder.to(DEVICE), unet.to(DEVICE), vae.to(DEVICE), tokens, latents)
        torch.cuda.synchronize()
        for m in (text_encoder, unet, vae):
            m.to("cpu")

        compute_stream = torch.cuda.Stream(priority=-1)
        load_stream = torch.cuda.Stream()
        te_hook = CpuOffloadHook(text_encoder, load_stream, compute_stream)
        unet_hook = CpuOffloadHook(unet, load_stream, compute_stream, prev_module_hook=te_hook)
        CpuOffloadHook(vae, load_stream, compute_stream, prev_module_hook=unet_hook)
        torch.cuda.synchronize()

        with torch.cuda.stream(compute_stream):
            out = run_pipeline(text_encoder, unet, vae, tokens, latents)

    torch.cuda.synchronize()
    checksum = out.double().sum().item()
    reference = ref.double().sum().item()
    match = torch.allclose(out, ref, rtol=1e-4, atol=1e-4)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
