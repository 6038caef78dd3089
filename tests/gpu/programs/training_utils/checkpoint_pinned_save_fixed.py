# Case: checkpoint_pinned_save (FIXED version)
# Source: NVIDIA/Megatron-LM issue #833 ("Why enable non_blocking=True when doing
# synchronous D2H?"): megatron/core/dist_checkpointing/strategies/filesystem_async.py
# copied tensors to CPU with non_blocking=True and then wrote them to disk with no
# stream/event synchronization; fixed in commit 66da23bff by adding
# torch.cuda.synchronize() after the transfer. Same concern raised in the review of
# PrimeIntellect-ai/prime-rl PR #3109 ("Async D2H corrupts checkpoint states").
# Fix: synchronize the stream that issued the non_blocking D2H copies before
# torch.save() reads the pinned buffers on the host.
import io

import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda:0")


class PinnedCheckpointer:
    """Reuses one set of pinned host buffers for every snapshot."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.host = None

    def _flat_state(self):
        state = {"model." + k: v for k, v in self.model.state_dict().items()}
        for i, p in enumerate(self.model.parameters()):
            for k, v in self.opt.state.get(p, {}).items():
                if torch.is_tensor(v) and v.is_cuda:
                    state["optim.%d.%s" % (i, k)] = v
        return state

    def save(self, step):
        state = self._flat_state()
        if self.host is None:
            self.host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                         for k, v in state.items()}
        for k, v in state.items():
            self.host[k].copy_(v.detach(), non_blocking=True)  # D2H into pinned memory
        torch.cuda.current_stream().synchronize()  # FIX: copies have landed in host memory
        buf = io.BytesIO()
        torch.save({"step": step, "state": self.host}, buf)  # host reads the pinned buffers
        return buf.getbuffer().nbytes


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024)).to(DEV)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    ckpt = PinnedCheckpointer(model, opt)
    g = torch.Generator().manual_seed(4)
    data = [torch.randn(256, 1024, generator=g).to(DEV) for _ in range(6)]
    sizes = []
    for step, x in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), x)
        loss.backward()
        opt.step()
        if step % 2 == 1:
            sizes.append(ckpt.save(step))
    torch.cuda.synchronize()
    print("saved %d checkpoints, %d bytes each" % (len(sizes), sizes[-1]))


if __name__ == "__main__":
    main()
