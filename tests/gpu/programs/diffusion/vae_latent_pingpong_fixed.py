# Source: ALJainProjects/LongLive-Optimized optimizations/async_vae.py (AsyncVAEPipeline: "decode frame N
#   while generating frame N+1", a separate vae_stream, double buffering with one CUDA event per buffer,
#   recorded on the VAE stream after the decode). Here the double buffer is the latent buffer: chunk k of a
#   streaming video is denoised in place in latent_buf[k % 2] on the default stream, and a per-chunk callback
#   hands that buffer to the VAE stream for decoding; chunk k+2 recycles the same buffer.
#
#   vae_latent_pingpong_bug.py:   the decode waits for the latents (RAW is ordered), but the generator
#                                 overwrites latent_buf[k % 2] for chunk k+2 without waiting for the decode
#                                 of chunk k to finish reading it (WAR between vae_stream and default).
#   vae_latent_pingpong_fixed.py: the default stream waits on decode_done[slot] before recycling the buffer.
import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms spin on the VAE stream (decode is the slow stage)
N_CHUNKS = 6
DENOISE_STEPS = 4
LAT_SHAPE = (16, 512)
PIX_DIM = 2048
DEVICE = torch.device("cuda:0")


class TinyVAEDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(LAT_SHAPE[1], PIX_DIM)

    def forward(self, latents):
        return torch.tanh(self.up(latents))


class TinyDenoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(LAT_SHAPE[1], LAT_SHAPE[1])

    def forward(self, latents):
        return torch.tanh(self.net(latents))


class AsyncChunkDecoder:
    def __init__(self, vae):
        self.vae = vae
        self.vae_stream = torch.cuda.Stream()
        self.decode_done = [torch.cuda.Event(), torch.cuda.Event()]
        self.frames = []  # decoded chunks stay referenced until flush()

    def decode_async(self, latents, slot):
        self.vae_stream.wait_stream(torch.cuda.current_stream())  # latents of this chunk are complete
        with torch.cuda.stream(self.vae_stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            self.frames.append(self.vae(latents))
            self.decode_done[slot].record()

    def flush(self):
        self.vae_stream.synchronize()
        return torch.cat(self.frames)


def denoise_chunk(denoiser, buf, noise):
    buf.copy_(noise)
    for t in range(DENOISE_STEPS):
        eps = denoiser(buf)
        buf.mul_(0.9).add_(eps, alpha=0.1 * (t + 1))


def generate(denoiser, noises, latent_buf, decoder):
    for k, noise in enumerate(noises):
        slot = k % 2
        buf = latent_buf[slot]
        # do not overwrite a latent buffer the VAE stream may still be reading (no-op before first record)
        torch.cuda.current_stream().wait_event(decoder.decode_done[slot])
        denoise_chunk(denoiser, buf, noise)
        decoder.decode_async(buf, slot)  # per-chunk callback: decode overlaps the next chunk


def main():
    torch.manual_seed(0)
    denoiser = TinyDenoiser().to(DEVICE)
    vae = TinyVAEDecoder().to(DEVICE)
    noises = [torch.randn(LAT_SHAPE, device=DEVICE) for _ in range(N_CHUNKS)]

    with torch.no_grad():
        ref_frames = []
        for noise in noises:
            lat = torch.empty(LAT_SHAPE, device=DEVICE)
            denoise_chunk(denoiser, lat, noise)
            ref_frames.append(vae(lat))
        ref = torch.cat(ref_frames)

        latent_buf = [torch.empty(LAT_SHAPE, device=DEVICE) for _ in range(2)]
        torch.cuda.synchronize()
        decoder = AsyncChunkDecoder(vae)
        generate(denoiser, noises, latent_buf, decoder)
        out = decoder.flush()

    torch.cuda.synchronize()
    checksum = out.double().sum().item()
    reference = ref.double().sum().item()
    match = torch.allclose(out, ref, rtol=1e-4, atol=1e-4)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
