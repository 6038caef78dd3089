# Source: fangwei123456/spikingjelly spikingjelly/activation_based/auto_cuda + neuron kernels (multi-step LIF node
#   with backend='cupy': a cupy.RawKernel launched on a CuPy stream over torch tensors, SJ's
#   `cupy_if_linear_forward` / `cuda_utils.DeviceEnvironment` path), with the stream hand-off done the way the
#   PyTorch/CuPy interop docs describe: torch -> CuPy through DLPack inside the CuPy stream context, CuPy -> torch through
#   torch.cuda.ExternalStream(cupy_stream.ptr).
# Bug: the node launches its kernel on a private CuPy stream created with non_blocking=True (no implicit ordering
#   with torch's legacy default stream).  cupy.from_dlpack() inside `with self._cp_stream:` makes the CuPy stream wait
#   for torch's current stream (inputs are safe), but nothing makes torch's default stream wait for the CuPy stream
#   before the next nn.Linear reads spike_seq.  The kernel (CuPy stream, writes spike_seq) races with the next layer
#   (default stream, reads spike_seq): device-device race on the spike tensors.
# Fix: after the launch, torch.cuda.current_stream().wait_stream(torch.cuda.ExternalStream(self._cp_stream.ptr)).
import cupy as cp
import numpy as np
import torch
import torch.nn as nn

KERNEL_CYCLES = 30_000_000  # a long multi-step kernel (large T * N)

_LIF_FORWARD = r"""
extern "C" __global__
void lif_multistep_forward(const float* x_seq, const float* v_init, float* spike_seq, float* v_seq,
                           const int T, const int N, const float decay, const float v_threshold,
                           const float v_reset)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    float v = v_init[i];
    for (int t = 0; t < T; t++) {
        const int idx = t * N + i;
        const float h = v + (x_seq[idx] - (v - v_reset)) * decay;
        const float s = h >= v_threshold ? 1.0f : 0.0f;
        spike_seq[idx] = s;
        v = s * v_reset + (1.0f - s) * h;
        v_seq[idx] = v;
    }
}
"""


def _launch_long_kernel_marker(cp_stream):
    # Stand-in for a long neuron kernel: keep the CuPy stream busy.
    with torch.cuda.stream(torch.cuda.ExternalStream(cp_stream.ptr)):
        torch.cuda._sleep(KERNEL_CYCLES)


class CupyMultiStepLIFNode(nn.Module):
    def __init__(self, tau=2.0, v_threshold=1.0, v_reset=0.0):
        super().__init__()
        self.decay, self.v_threshold, self.v_reset = 1.0 / tau, v_threshold, v_reset
        self._kernel = cp.RawKernel(_LIF_FORWARD, "lif_multistep_forward", options=("--fmad=false",))
        self._cp_stream = cp.cuda.Stream(non_blocking=True)  # private stream so neuron kernels overlap GEMMs
        self.saved_tensors = []  # ctx.save_for_backward stand-in: keep what the kernel touched alive

    def forward(self, x_seq):
        x_seq = x_seq.contiguous()
        T, N = x_seq.shape[0], x_seq[0].numel()
        v_init = torch.full((N,), self.v_reset, device=x_seq.device)
        spike_seq = torch.empty_like(x_seq)
        v_seq = torch.empty_like(x_seq)
        with self._cp_stream:
            args = [cp.from_dlpack(t) for t in (x_seq, v_init, spike_seq, v_seq)]
            _launch_long_kernel_marker(self._cp_stream)
            threads = 256
            self._kernel(((N + threads - 1) // threads,), (threads,),
                         (*args, np.int32(T), np.int32(N), np.float32(self.decay),
                          np.float32(self.v_threshold), np.float32(self.v_reset)))
        self.saved_tensors.append((x_seq, v_init, spike_seq, v_seq))
        return spike_seq


def lif_reference(x_seq, decay, v_threshold, v_reset):
    v = torch.full_like(x_seq[0], v_reset)
    spikes = []
    for t in range(x_seq.shape[0]):
        h = v + (x_seq[t] - (v - v_reset)) * decay
        s = (h >= v_threshold).float()
        spikes.append(s)
        v = s * v_reset + (1.0 - s) * h
    return torch.stack(spikes)


class SpikingMLP(nn.Module):
    def __init__(self, d_in=256, hidden=512, d_out=10):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d_in, hidden), CupyMultiStepLIFNode(), nn.Linear(hidden, hidden),
                                     CupyMultiStepLIFNode(), nn.Linear(hidden, d_out)])

    def forward(self, x_seq):
        for layer in self.layers:
            x_seq = layer(x_seq)
        return x_seq.mean(0)  # rate readout over T


@torch.no_grad()
def reference_forward(net, x_seq):
    for layer in net.layers:
        if isinstance(layer, CupyMultiStepLIFNode):
            x_seq = lif_reference(x_seq, layer.decay, layer.v_threshold, layer.v_reset)
        else:
            x_seq = layer(x_seq)
    return x_seq.mean(0)


def main():
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    net = SpikingMLP().to(device)
    x_seq = torch.rand(8, 64, 256, device=device) * 4.0  # [T, B, D] encoded input current

    with torch.no_grad():
        out = net(x_seq)
    torch.cuda.synchronize(device)
    expected = reference_forward(net, x_seq)
    torch.cuda.synchronize(device)

    diff = (out - expected).abs().max().item()
    print(f"max|diff|={diff:.3g}")
    print(f"match={torch.allclose(out, expected, atol=1e-5)}")


if __name__ == "__main__":
    main()
