# Source: thewhatifproject/StreamDiffusion src/streamdiffusion/acceleration/tensorrt/runtime_engines/
#   controlnet_engine.py and utilities.py (Engine.allocate_buffers / Engine.infer): the ControlNet TensorRT
#   engine runs on its own CUDA stream (a polygraphy cuda.Stream, i.e. a stream PyTorch did not create),
#   writes into output tensors the engine pre-allocated once, and the caller host-synchronizes that stream
#   after infer(). Also diffusers StableDiffusionAdapterPipeline, which computes the T2I-Adapter features
#   once per call and adds them to the UNet at every denoising step.
#
# The host synchronize is replaced by an event handoff so that the adapter engine overlaps the text encoder.
# The engine stream is wrapped with torch.cuda.ExternalStream (the raw handle here comes from a stream object
# that stands in for the engine runtime's cudaStream_t; it is non-blocking, like every torch-created stream).
#   adapter_engine_event_bug.py:   features_ready.record() is called after leaving the engine-stream context,
#                                  so it is recorded on the default stream; wait_event() on it orders nothing
#                                  and the UNet reads the feature buffers before the engine has written them.
#   adapter_engine_event_fixed.py: the event is recorded on the engine stream.
import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms spin on the engine stream (the adapter engine is the slow branch)
DEVICE = torch.device("cuda:0")
HINT_DIM = 768
FEAT_DIMS = (320, 640, 1280)
BATCH = 4
TEXT_DIM = 1280
STEPS = 4


class TinyT2IAdapter(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList([nn.Linear(HINT_DIM, d) for d in FEAT_DIMS])

    def forward(self, hint):
        return [torch.tanh(stage(hint)) for stage in self.stages]


class AdapterEngine:
    """Stand-in for a TensorRT adapter engine: owns its output buffers and runs on an external stream."""

    def __init__(self, adapter, stream):
        self.adapter = adapter
        self.stream = stream
        # allocate_buffers(): once, reused by every infer() call
        self.outputs = [torch.zeros(BATCH, d, device=DEVICE) for d in FEAT_DIMS]

    def infer(self, control_image):
        self.stream.wait_stream(torch.cuda.current_stream())  # the preprocessed hint comes from torch's stream
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            for out, feat in zip(self.outputs, self.adapter(control_image)):
                out.copy_(feat)
        features_ready = torch.cuda.Event()
        # record on the engine stream, not on the caller's current stream
        features_ready.record(self.stream)
        return self.outputs, features_ready


class TinyUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.ModuleList([nn.Linear(TEXT_DIM, d) for d in FEAT_DIMS])
        self.up = nn.ModuleList([nn.Linear(d, TEXT_DIM) for d in FEAT_DIMS])

    def forward(self, latents, prompt_embeds, adapter_feats):
        h = latents + prompt_embeds
        out = torch.zeros_like(latents)
        for down, up, feat in zip(self.down, self.up, adapter_feats):
            out = out + up(torch.tanh(down(h)) + feat)  # down_intrablock_additional_residuals
        return out


def denoise(unet, latents, prompt_embeds, feats):
    for _ in range(STEPS):
        latents = latents - 0.1 * torch.tanh(unet(latents, prompt_embeds, feats))
    return latents


def main():
    torch.manual_seed(0)
    adapter = TinyT2IAdapter().to(DEVICE)
    unet = TinyUNet().to(DEVICE)
    text_encoder = nn.Linear(TEXT_DIM, TEXT_DIM).to(DEVICE)
    raw_hint = torch.rand(BATCH, HINT_DIM, device=DEVICE)
    tokens = torch.randn(BATCH, TEXT_DIM, device=DEVICE)
    latents0 = torch.randn(BATCH, TEXT_DIM, device=DEVICE)

    with torch.no_grad():
        ref = denoise(unet, latents0, text_encoder(tokens), adapter(raw_hint * 2 - 1))

        engine_runtime_stream = torch.cuda.Stream()  # owned by the "engine runtime"
        engine_stream = torch.cuda.ExternalStream(engine_runtime_stream.cuda_stream, device=DEVICE)
        engine = AdapterEngine(adapter, engine_stream)
        torch.cuda.synchronize()

        control_image = raw_hint * 2 - 1  # preprocessing on the default stream
        feats, features_ready = engine.infer(control_image)
        prompt_embeds = text_encoder(tokens)  # overlaps with the adapter engine
        torch.cuda.current_stream().wait_event(features_ready)
        out = denoise(unet, latents0, prompt_embeds, feats)

    torch.cuda.synchronize()
    checksum = out.double().sum().item()
    reference = ref.double().sum().item()
    match = torch.allclose(out, ref, rtol=1e-4, atol=1e-4)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
