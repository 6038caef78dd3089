# Case: pinned_batch_reuse (FIXED version)
# Source: NVIDIA/Megatron-LM PR #5715 ("IMA fix by making the copy of book keeping buffer
# to GPU blocking"): a pinned CPU buffer was copied to the GPU with non_blocking=True and
# then overwritten for the next step before the in-flight copy had read it. Also
# pytorch/pytorch issue #126946 (ezyang: with non_blocking "it's your responsibility to
# ensure that the src memory stays live and unmodified for as long as the transfer is in
# progress") and the pytorch/tutorials pinmem_nonblock tutorial (PR #3261).
# Here a loader keeps ONE pinned staging batch (pin_memory() once, reused every step) to
# avoid re-pinning cost.
# Fix: record an event after the H2D copies and synchronize on it before the host
# overwrites the pinned staging buffers for the next batch.
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda:0")


class PinnedStagingLoader:
    def __init__(self, n_batches, batch, dim, n_cls, seed=0):
        self.rng = np.random.default_rng(seed)
        self.n_batches, self.batch, self.dim, self.n_cls = n_batches, batch, dim, n_cls
        # pinned once, reused for every batch
        self.x_pinned = torch.empty(batch, dim, dtype=torch.float32).pin_memory()
        self.y_pinned = torch.empty(batch, dtype=torch.int64).pin_memory()
        self.copied = torch.cuda.Event()  # FIX

    def _decode(self):
        x = self.rng.standard_normal((self.batch, self.dim), dtype=np.float32)
        y = self.rng.integers(0, self.n_cls, size=(self.batch,), dtype=np.int64)
        return torch.from_numpy(x), torch.from_numpy(y)

    def __iter__(self):
        for _ in range(self.n_batches):
            x_cpu, y_cpu = self._decode()
            self.copied.synchronize()  # FIX: previous H2D copies have read the buffers
            self.x_pinned.copy_(x_cpu)  # host write into pinned memory
            self.y_pinned.copy_(y_cpu)
            x = self.x_pinned.to(DEV, non_blocking=True)  # async H2D reads pinned memory
            y = self.y_pinned.to(DEV, non_blocking=True)
            self.copied.record()  # FIX
            yield x, y


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(),
                          nn.Linear(2048, 100)).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    loader = PinnedStagingLoader(n_batches=10, batch=1024, dim=512, n_cls=100)
    losses = []
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    print("mean loss %.4f" % torch.stack(losses).mean().item())


if __name__ == "__main__":
    main()
