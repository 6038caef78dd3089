# Case: VAE tiled decode with tile rows spread over two CUDA streams.
# Source: plausible pattern. Tiling geometry follows diffusers AutoencoderKL.tiled_decode
#   (src/diffusers/models/autoencoders/autoencoder_kl.py: overlap_size / blend_extent / row_limit,
#   blend_h); tile-parallel decoders exist in xdit-project/xDiT PR #750 (DistVAE) and
#   vllm-project/vllm-omni PR #1350, which distribute tiles over ranks rather than streams.
#   Here tile rows alternate between two streams and each tile is pasted into a shared canvas.
# BUG: tiles are pasted with their full (overlapping) height, so consecutive tile rows - decoded
#   on different streams - write the same `blend_extent` canvas rows with no ordering between them.
import torch
import torch.nn as nn
import torch.nn.functional as F


class Decoder(nn.Module):
    def __init__(self, latent_ch=4, ch=64, up=8):
        super().__init__()
        self.conv_in = nn.Conv2d(latent_ch, ch, 3, padding=1)
        self.mid = nn.Sequential(nn.GroupNorm(8, ch), nn.SiLU(), nn.Conv2d(ch, ch, 3, padding=1))
        self.up = up
        self.conv_out = nn.Sequential(nn.GroupNorm(8, ch), nn.SiLU(), nn.Conv2d(ch, 3, 3, padding=1))

    def forward(self, z):
        h = self.conv_in(z)
        h = h + self.mid(h)
        h = F.interpolate(h, scale_factor=self.up, mode="nearest")
        return self.conv_out(h)


class TiledAutoencoder(nn.Module):
    def __init__(self, tile_latent_min_size=32, tile_overlap_factor=0.25, scale=8):
        super().__init__()
        self.post_quant_conv = nn.Conv2d(4, 4, 1)
        self.decoder = Decoder(up=scale)
        self.scale = scale
        self.tile_latent_min_size = tile_latent_min_size
        self.tile_sample_min_size = tile_latent_min_size * scale
        self.tile_overlap_factor = tile_overlap_factor
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    @staticmethod
    def blend_h(a, b, blend_extent):
        blend_extent = min(a.shape[3], b.shape[3], blend_extent)
        w = torch.arange(blend_extent, device=b.device, dtype=b.dtype) / blend_extent
        b[:, :, :, :blend_extent] = a[:, :, :, -blend_extent:] * (1 - w) + b[:, :, :, :blend_extent] * w
        return b

    def decode_tile_row(self, z, i, out, overlap_size, blend_extent, row_limit):
        prev = None
        y0 = (i // overlap_size) * row_limit
        for j in range(0, z.shape[3], overlap_size):
            tile = z[:, :, i:i + self.tile_latent_min_size, j:j + self.tile_latent_min_size]
            tile = self.decoder(self.post_quant_conv(tile))
            if prev is not None:
                tile = self.blend_h(prev, tile, blend_extent)  # same stream as prev: ordered
            prev = tile
            x0 = (j // overlap_size) * row_limit
            h = min(tile.shape[2], out.shape[2] - y0)          # BUG: full tile height, not row_limit
            w = min(tile.shape[3] if j + overlap_size >= z.shape[3] else row_limit, out.shape[3] - x0)
            out[:, :, y0:y0 + h, x0:x0 + w].copy_(tile[:, :, :h, :w])

    def tiled_decode(self, z):
        overlap_size = int(self.tile_latent_min_size * (1 - self.tile_overlap_factor))
        blend_extent = int(self.tile_sample_min_size * self.tile_overlap_factor)
        row_limit = self.tile_sample_min_size - blend_extent
        b, _, H, W = z.shape
        out = torch.empty(b, 3, H * self.scale, W * self.scale, device=z.device)
        main = torch.cuda.current_stream()
        for s in self.streams:
            s.wait_stream(main)  # z and out were produced/allocated on the main stream
        for n, i in enumerate(range(0, H, overlap_size)):
            s = self.streams[n % 2]
            with torch.cuda.stream(s):
                self.decode_tile_row(z, i, out, overlap_size, blend_extent, row_limit)
        for s in self.streams:
            main.wait_stream(s)
        return out


class Pipeline:
    def __init__(self, vae):
        self.vae = vae

    @torch.no_grad()
    def __call__(self, latents):
        image = self.vae.tiled_decode(latents / 0.18215)
        image = (image / 2 + 0.5).clamp(0, 1)
        return (image * 255).round().to(torch.uint8)


def main():
    torch.manual_seed(0)
    vae = TiledAutoencoder().cuda().eval()
    pipe = Pipeline(vae)
    g = torch.Generator(device="cuda").manual_seed(0)
    latents = torch.randn(1, 4, 64, 64, device="cuda", generator=g)
    images = [pipe(latents) for _ in range(2)]
    torch.cuda.synchronize()
    print("image", tuple(images[-1].shape), images[-1].float().mean().item())


if __name__ == "__main__":
    main()
