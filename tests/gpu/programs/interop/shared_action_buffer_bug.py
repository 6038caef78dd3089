# Source: plausible pattern (GPU-resident RL environment: a torch policy writes its actions
# into a persistent buffer that a CuPy simulator reads through a zero-copy view created
# once with cupy.from_dlpack in the constructor).  The DLPack stream hand-shake only
# happens at conversion time (once, in GpuSim.__init__); afterwards every write made by
# torch on its current stream and every read made by the CuPy ElementwiseKernel on the
# simulator stream must be ordered explicitly.  Two races on `actions` (no edge in either
# direction between torch's default stream and GpuSim.stream):
#  (1) read-after-write: torch.mul(..., out=sim.actions_t) on the default stream vs the
#      sim_step ElementwiseKernel reading sim.actions on GpuSim.stream in the same step;
#  (2) write-after-read: the next step's torch.mul(..., out=sim.actions_t) vs the previous
#      step's sim_step kernel still reading the buffer on GpuSim.stream.
# Fix (_fixed.py): torch's stream waits for the simulator stream before writing the buffer,
# and the simulator stream waits for torch's stream before reading it (torch.cuda.ExternalStream
# over the CuPy stream + wait_stream, both directions).
import numpy
import torch
import cupy

N_ENVS = 1 << 20
STEPS = 16
SPIN_CYCLES = 20_000_000  # ~10 ms: stands in for the policy network forward pass


class GpuSim:
    def __init__(self, n):
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.actions_t = torch.zeros(n, device='cuda')
        with self.stream:
            self.actions = cupy.from_dlpack(self.actions_t)  # shared view, synced once here
            self.state = cupy.zeros(n, dtype=cupy.float32)
        self.stream.synchronize()
        self.step_kernel = cupy.ElementwiseKernel(
            'float32 s, float32 a', 'float32 s_new',
            's_new = 0.9f * s + 0.1f * tanhf(a)',
            'interop_sim_step')

    def step(self):
        with self.stream:
            self.state = self.step_kernel(self.state, self.actions)


def main():
    rng = numpy.random.default_rng(11)
    obs_host = [rng.standard_normal(N_ENVS, dtype=numpy.float32) for _ in range(STEPS)]
    obs = [torch.from_numpy(o).cuda() for o in obs_host]

    sim = GpuSim(N_ENVS)
    # warm-up: compile the ElementwiseKernel on a throw-away state (host-synchronised)
    with sim.stream:
        sim.step_kernel(cupy.zeros(4, dtype=cupy.float32), cupy.zeros(4, dtype=cupy.float32))
    torch.cuda.synchronize()
    cupy.cuda.Device(0).synchronize()

    for i in range(STEPS):
        # BUG: no wait for the simulator's read of the previous actions (write-after-read).
        torch.cuda._sleep(SPIN_CYCLES)                 # policy forward pass
        torch.mul(obs[i], 2.0, out=sim.actions_t)      # write actions in place
        # BUG: no wait for torch's write before the simulator reads (read-after-write).
        sim.step()

    torch.cuda.synchronize()
    cupy.cuda.Device(0).synchronize()

    state = sim.state.get()
    checksum = float(numpy.sum(state, dtype=numpy.float64))
    s = numpy.zeros(N_ENVS, dtype=numpy.float32)
    for o in obs_host:
        s = numpy.float32(0.9) * s + numpy.float32(0.1) * numpy.tanh(o * numpy.float32(2.0))
    ref = float(numpy.sum(s, dtype=numpy.float64))
    ok = abs(checksum - ref) <= 1e-4 * max(1.0, abs(ref))
    print(f'checksum={checksum:.6f} reference={ref:.6f} match={ok}')


if __name__ == '__main__':
    main()
