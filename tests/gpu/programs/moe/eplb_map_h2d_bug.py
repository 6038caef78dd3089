# Source: vllm-project/vllm PR #24527 / #25279 "[BugFix] Fix async scheduling CPU tensor race": reused
#   pinned CPU tensors (CpuGpuBuffer .cpu/.np) are rewritten on the host for step N+1 while the
#   non_blocking H2D copy of step N is still queued; the fix records prepare_inputs_event after the
#   copies and synchronizes it (in a context manager around input preparation) before the host
#   touches the CPU tensors again. Here the reused buffer is the EPLB logical->physical expert map
#   (vllm/distributed/eplb/eplb_state.py logical_to_physical_map) that a host-side balancer rewrites
#   every step.
# Bug (eplb_map_h2d_bug.py): synchronize_input_prep() does not wait on the event, so the NumPy write
#   into the pinned map for step N+1 races with the H2D copy of step N, which is queued behind the
#   still-running forward on the default stream.
# Fix (eplb_map_h2d_fixed.py): prepare_inputs_event.synchronize() before yielding.
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

SLEEP_CYCLES = 20_000_000  # ~10 ms on the default stream (previous step's forward still running)
H, FFN, LOGICAL, PHYSICAL, T, STEPS = 256, 512, 4, 8, 1024, 4
DEV = torch.device("cuda:0")


class CpuGpuMap:
    """Pinned host copy + device copy of logical->physical expert map (one replica per logical)."""

    def __init__(self, n):
        self.cpu = torch.zeros(n, dtype=torch.int64).pin_memory()
        self.np = self.cpu.numpy()                       # shares the pinned memory
        self.gpu = torch.zeros(n, dtype=torch.int64, device=DEV)

    def copy_to_gpu(self):
        self.gpu.copy_(self.cpu, non_blocking=True)
        return self.gpu


class Runner:
    def __init__(self):
        self.expert_map = CpuGpuMap(LOGICAL)
        self.prepare_inputs_event = torch.cuda.Event()

    @contextmanager
    def synchronize_input_prep(self):
        try:
            yield
        finally:
            self.prepare_inputs_event.record()

    def step(self, step_idx, x, router, w_phys):
        with self.synchronize_input_prep():
            self.expert_map.np[:] = balancer_plan(step_idx)   # host write into pinned memory
            torch.cuda._sleep(SLEEP_CYCLES)
            l2p = self.expert_map.copy_to_gpu()
        return moe_forward(x, router, w_phys, l2p)


def balancer_plan(step_idx):
    # rotate which physical replica serves each logical expert (replicas e and e + LOGICAL)
    return np.array([e + LOGICAL * ((step_idx + e) % 2) for e in range(LOGICAL)], dtype=np.int64)


def moe_forward(x, router, w_phys, l2p):
    gates = torch.softmax(x @ router, dim=-1)            # [T, LOGICAL]
    w = w_phys.index_select(0, l2p)                      # physical weights per logical expert
    out = torch.zeros_like(x)
    for e in range(LOGICAL):
        out += (F.silu(x @ w[e, :, :FFN]) @ w[e, :, FFN:].t()) * gates[:, e:e + 1]
    return out


@torch.no_grad()
def main():
    torch.manual_seed(0)
    router = torch.randn(H, LOGICAL, device=DEV)
    # replicas differ on purpose (a scaled copy), so a stale map changes the result
    base = torch.randn(LOGICAL, H, 2 * FFN, device=DEV) * H ** -0.5
    w_phys = torch.cat([base, base * 1.5], dim=0)        # [PHYSICAL, H, 2*FFN]
    xs = [torch.randn(T, H, device=DEV) for _ in range(STEPS)]
    torch.cuda.synchronize()

    refs = []
    for s in range(STEPS):
        l2p = torch.from_numpy(balancer_plan(s)).to(DEV)
        refs.append(moe_forward(xs[s], router, w_phys, l2p))
    torch.cuda.synchronize()

    runner = Runner()
    outs = [runner.step(s, xs[s], router, w_phys) for s in range(STEPS)]
    torch.cuda.synchronize()

    out, ref = torch.stack(outs), torch.stack(refs)
    checksum = out.double().abs().sum().item()
    reference = ref.double().abs().sum().item()
    match = torch.allclose(out, ref, rtol=1e-3, atol=1e-3)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
