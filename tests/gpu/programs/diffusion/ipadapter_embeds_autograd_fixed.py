# Source: tencent-ailab/IP-Adapter tutorial_train.py (read from the fork gasparitiago/IP-Adapter): the frozen
#   CLIP image encoder computes image_embeds under torch.no_grad(), the trainable image_proj_model consumes
#   them, then accelerator.backward(loss) and optimizer.step(). Here the frozen encoder is moved onto a side
#   stream so it can run ahead of the UNet; the consumer waits on an event, which orders the data but not
#   the memory's lifetime. The lifetime rule is the one in the torch.Tensor.record_stream docs and in
#   NVIDIA apex examples/imagenet/main_amp.py data_prefetcher (input.record_stream(current_stream())).
#
# IP-Adapter training step: image_embeds are allocated on enc_stream, read on the default stream by the
# projection in forward AND in backward (saved for the weight gradient), and dropped when the next step
# rebinds the name.
#   ipadapter_embeds_autograd_bug.py:   no record_stream: the allocator returns the block to enc_stream's
#                                       pool, the encoder of a later step writes into it while the default
#                                       stream has not yet run this step's forward/backward.
#   ipadapter_embeds_autograd_fixed.py: image_embeds.record_stream(default stream) after the event wait.
import torch
import torch.nn as nn
import torch.nn.functional as F

SLEEP_CYCLES = 20_000_000  # ~10 ms spin on the default stream (stand-in for the UNet forward)
STEPS = 6
BATCH = 8
CLIP_DIM = 768
EMB_DIM = 1024
LAT_DIM = 512
LR = 0.5
DEVICE = torch.device("cuda:0")


class FrozenImageEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(CLIP_DIM, EMB_DIM)
        self.fc2 = nn.Linear(EMB_DIM, EMB_DIM)
        self.requires_grad_(False)

    def forward(self, clip_images):
        return self.fc2(F.gelu(self.fc1(clip_images)))


class TinyUNet(nn.Module):
    """Frozen denoiser; the IP-Adapter projection adds image tokens to its output."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(LAT_DIM, LAT_DIM)
        self.requires_grad_(False)

    def forward(self, noisy_latents, ip_tokens):
        torch.cuda._sleep(SLEEP_CYCLES)
        return self.body(noisy_latents) + ip_tokens


def make_batches():
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        clip_images = torch.randn(BATCH, CLIP_DIM, generator=g)
        noisy = torch.randn(BATCH, LAT_DIM, generator=g)
        noise = torch.randn(BATCH, LAT_DIM, generator=g)
        batches.append(tuple(t.to(DEVICE) for t in (clip_images, noisy, noise)))
    return batches


def train(image_encoder, unet, image_proj, batches, enc_stream):
    optimizer = torch.optim.SGD(image_proj.parameters(), lr=LR)
    for clip_images, noisy, noise in batches:
        if enc_stream is None:
            with torch.no_grad():
                image_embeds = image_encoder(clip_images)
        else:
            with torch.cuda.stream(enc_stream), torch.no_grad():
                image_embeds = image_encoder(clip_images)
            embeds_ready = torch.cuda.Event()
            embeds_ready.record(enc_stream)
            torch.cuda.current_stream().wait_event(embeds_ready)
            # the default stream uses image_embeds (forward and backward) after it is dropped on the host
            image_embeds.record_stream(torch.cuda.current_stream())
        noise_pred = unet(noisy, image_proj(image_embeds))
        loss = F.mse_loss(noise_pred, noise)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return image_proj.weight.detach()


def main():
    torch.manual_seed(0)
    image_encoder = FrozenImageEncoder().to(DEVICE)
    unet = TinyUNet().to(DEVICE)
    proj_init = nn.Linear(EMB_DIM, LAT_DIM).state_dict()
    batches = make_batches()

    ref_proj = nn.Linear(EMB_DIM, LAT_DIM).to(DEVICE)
    ref_proj.load_state_dict(proj_init)
    ref_w = train(image_encoder, unet, ref_proj, batches, enc_stream=None)
    torch.cuda.synchronize()

    image_proj = nn.Linear(EMB_DIM, LAT_DIM).to(DEVICE)
    image_proj.load_state_dict(proj_init)
    torch.cuda.synchronize()
    enc_stream = torch.cuda.Stream()
    w = train(image_encoder, unet, image_proj, batches, enc_stream=enc_stream)

    torch.cuda.synchronize()
    checksum = w.double().abs().sum().item()
    reference = ref_w.double().abs().sum().item()
    match = torch.allclose(w, ref_w, rtol=1e-4, atol=1e-5)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
