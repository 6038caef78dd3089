# Source: NVIDIA TensorRT tools/pytorch-quantization, pytorch_quantization/calib/max.py MaxCalibrator.collect()
#   with track_amax=True (`self._amaxs.append(local_amax.cpu().numpy())`), driven by
#   nn/modules/tensor_quantizer.py TensorQuantizer in calibration mode (enable_calib()/disable_quant(), then
#   load_calib_amax()) as in the collect_stats() loop of the PTQ examples. Here the per-call blocking `.cpu()`
#   (and the `torch.min(x) < 0` check, which also syncs) were replaced by a non_blocking copy of the per-channel
#   amax into a pinned staging buffer that is drained into `_amaxs` once per calibration batch.
# Bug: MaxCalibrator.collect() enqueues `staging.copy_(local_amax, non_blocking=True)` (device->pinned host) on
#   the default stream; flush_tracked_amax() then reads the pinned staging buffer on the host
#   (`self._staging.numpy()`) with nothing that waits for that copy. While the GPU lags (a big model
#   ahead of the quantizers) the host records the previous batch's amax (or zeros) instead of this batch's.
#   Race: default-stream D2H write of the pinned `_staging` tensor vs the host read in flush_tracked_amax().
# Fix: record a torch.cuda.Event right after the copy and call event.synchronize() before the host reads it.
import numpy as np
import torch
import torch.nn.functional as F

DEV = "cuda:0"
HIDDEN = 1024
TOKENS = 512
N_LAYERS = 4
N_BATCHES = 6
BACKBONE_CYCLES = 25_000_000  # the rest of the network, before the quantized block


class MaxCalibrator:
    def __init__(self, num_channels, track_amax=True):
        self._track_amax = track_amax
        self._amaxs = []
        self._calib_amax = None
        self._staging = torch.zeros(num_channels, pin_memory=True)

    def collect(self, x):
        x = x.detach().abs()
        local_amax = x.reshape(-1, x.shape[-1]).amax(dim=0)  # axis=-1: one amax per input channel
        if self._calib_amax is None:
            self._calib_amax = local_amax
        else:
            self._calib_amax.copy_(torch.max(self._calib_amax, local_amax))
        if self._track_amax:
            self._staging.copy_(local_amax, non_blocking=True)

    def flush_tracked_amax(self):
        if self._track_amax:
            self._amaxs.append(self._staging.numpy().copy())

    def compute_amax(self):
        return self._calib_amax


class TensorQuantizer(torch.nn.Module):
    def __init__(self, num_channels, num_bits=8):
        super().__init__()
        self._num_bits = num_bits
        self._calibrator = MaxCalibrator(num_channels)
        self._if_calib = False
        self._if_quant = True
        self._amax = None

    def enable_calib(self):
        self._if_calib = True

    def disable_quant(self):
        self._if_quant = False

    def load_calib_amax(self):
        self._amax = self._calibrator.compute_amax().clone()
        self._if_calib, self._if_quant = False, True

    def forward(self, x):
        if self._if_calib:
            self._calibrator.collect(x)
        if self._if_quant and self._amax is not None:
            bound = 2 ** (self._num_bits - 1) - 1
            s = bound / self._amax
            x = torch.clamp(torch.round(x * s), -bound, bound) / s
        return x


class QuantLinear(torch.nn.Linear):
    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, device=DEV)
        self._input_quantizer = TensorQuantizer(in_features)

    def forward(self, x):
        return F.linear(self._input_quantizer(x), self.weight, self.bias)


def collect_stats(model, batches):
    quantizers = [m for m in model.modules() if isinstance(m, TensorQuantizer)]
    for q in quantizers:
        q.disable_quant()
        q.enable_calib()
    for x in batches:
        torch.cuda._sleep(BACKBONE_CYCLES)
        model(x)
        for q in quantizers:
            q._calibrator.flush_tracked_amax()
    for q in quantizers:
        q.load_calib_amax()
    return quantizers


@torch.no_grad()
def main():
    torch.manual_seed(0)
    layers = []
    for _ in range(N_LAYERS):
        layers += [QuantLinear(HIDDEN, HIDDEN), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).eval()
    gain = torch.arange(1, N_BATCHES + 1, device=DEV, dtype=torch.float32)[:, None, None]
    batches = torch.randn(N_BATCHES, TOKENS, HIDDEN, device=DEV) * gain

    quantizers = collect_stats(model, batches)
    torch.cuda.synchronize()

    # reference: per batch, per layer input amax read back with blocking copies
    ok = True
    for b in range(N_BATCHES):
        h = batches[b]
        for li, lin in enumerate(m for m in model if isinstance(m, QuantLinear)):
            ref = h.abs().amax(dim=0).cpu().numpy()
            ok &= bool(np.allclose(quantizers[li]._calibrator._amaxs[b], ref, rtol=1e-6, atol=0))
            h = torch.relu(F.linear(h, lin.weight, lin.bias))
    tracked_max = np.max(np.stack(quantizers[0]._calibrator._amaxs), axis=0)
    final = quantizers[0]._amax.cpu().numpy()
    ok &= bool(np.allclose(tracked_max, final, rtol=1e-6, atol=0))
    print(f"layer0 tracked max={tracked_max.max():.4f} calib_amax={final.max():.4f}")
    print(f"match={ok}")


if __name__ == "__main__":
    main()
