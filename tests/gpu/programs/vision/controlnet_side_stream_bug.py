# Case: ControlNet evaluated on a side stream, concurrently with the UNet's timestep embedding and
# conv_in on the default stream (two-model diffusion pipeline).
# Source: plausible pattern. Pipeline / residual structure follows diffusers
#   StableDiffusionControlNetPipeline (controlnet(...) -> down_block_res_samples, mid_block_res_sample
#   passed to unet(...)); the runner that overlaps the two models on streams is not from a real repo.
# BUG: the step grabs `runner.done` *before* launch() replaces it with a fresh event, so the default
#   stream waits on the previous step's event (or, at step 0, on a never-recorded event = no-op) and
#   the UNet reads the residuals while the ControlNet may still be writing them.
import torch
import torch.nn as nn
import torch.nn.functional as F


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-torch.arange(half, device=t.device, dtype=torch.float32) * (9.21 / half))
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(8, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(tdim, cout)
        self.n2, self.c2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.c1(F.silu(self.n1(x))) + self.t(temb)[:, :, None, None]
        return self.skip(x) + self.c2(F.silu(self.n2(h)))


class UNet(nn.Module):
    def __init__(self, ch=(64, 128, 128), tdim=256):
        super().__init__()
        self.tdim = tdim
        self.time_mlp = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.conv_in = nn.Conv2d(4, ch[0], 3, padding=1)
        self.down = nn.ModuleList([ResBlock(ch[max(i - 1, 0)], ch[i], tdim) for i in range(len(ch))])
        self.mid = ResBlock(ch[-1], ch[-1], tdim)
        self.up = nn.ModuleList([ResBlock(2 * ch[i], ch[max(i - 1, 0)], tdim) for i in reversed(range(len(ch)))])
        self.conv_out = nn.Conv2d(ch[0], 4, 3, padding=1)

    def embed(self, t):
        return self.time_mlp(timestep_embedding(t, self.tdim))

    def forward(self, x, temb, down_block_additional_residuals, mid_block_additional_residual):
        h = self.conv_in(x)
        skips = []
        for i, blk in enumerate(self.down):
            h = blk(h, temb) + down_block_additional_residuals[i]
            skips.append(h)
            if i < len(self.down) - 1:
                h = F.avg_pool2d(h, 2)
        h = self.mid(h, temb) + mid_block_additional_residual
        for i, blk in enumerate(self.up):
            h = blk(torch.cat([h, skips.pop()], 1), temb)
            if i < len(self.up) - 1:
                h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        return self.conv_out(h)


class ControlNet(UNet):
    def __init__(self, ch=(64, 128, 128), tdim=256):
        super().__init__(ch, tdim)
        self.cond_embedding = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.SiLU(),
                                            nn.Conv2d(16, ch[0], 3, stride=8, padding=1))
        self.zero_convs = nn.ModuleList([nn.Conv2d(c, c, 1) for c in ch])
        self.mid_zero = nn.Conv2d(ch[-1], ch[-1], 1)

    def forward(self, x, t, cond_image, scale=1.0):
        temb = self.embed(t)
        h = self.conv_in(x) + self.cond_embedding(cond_image)
        res = []
        for i, blk in enumerate(self.down):
            h = blk(h, temb)
            res.append(self.zero_convs[i](h) * scale)
            if i < len(self.down) - 1:
                h = F.avg_pool2d(h, 2)
        return res, self.mid_zero(self.mid(h, temb)) * scale


class ControlNetRunner:
    """Runs the ControlNet of the current step on its own stream."""

    def __init__(self, controlnet):
        self.controlnet = controlnet
        self.stream = torch.cuda.Stream()
        self.done = torch.cuda.Event()

    def launch(self, latents, t, cond_image):
        self.done = torch.cuda.Event()  # fresh event for this step
        consumer = torch.cuda.current_stream()
        self.stream.wait_stream(consumer)  # latents were produced on the consumer stream
        with torch.cuda.stream(self.stream):
            down, mid = self.controlnet(latents, t, cond_image)
        for r in (latents, t):
            r.record_stream(self.stream)
        for r in down + [mid]:
            r.record_stream(consumer)
        self.done.record(self.stream)
        return down, mid


@torch.no_grad()
def main():
    torch.manual_seed(0)
    unet, controlnet = UNet().cuda().eval(), ControlNet().cuda().eval()
    runner = ControlNetRunner(controlnet)
    g = torch.Generator(device="cuda").manual_seed(0)
    cond_image = torch.rand(2, 3, 256, 256, device="cuda", generator=g)
    latents = torch.randn(2, 4, 32, 32, device="cuda", generator=g)
    timesteps = torch.linspace(999, 0, 6, device="cuda").long()
    alphas = torch.linspace(0.1, 0.9, 6).tolist()
    for k in range(len(timesteps)):
        t = timesteps[k].expand(2).contiguous()
        done = runner.done  # BUG: taken before launch() installs this step's event
        down_res, mid_res = runner.launch(latents, t, cond_image)
        temb = unet.embed(t)  # overlaps with the ControlNet on the side stream
        torch.cuda.current_stream().wait_event(done)
        noise_pred = unet(latents, temb, down_res, mid_res)
        latents = (latents - (1 - alphas[k]) ** 0.5 * noise_pred) / alphas[k] ** 0.5
    torch.cuda.synchronize()
    print("latents", latents.mean().item())


if __name__ == "__main__":
    main()
