"""view_keepalive (bug version).

Sources:
  * record_stream() on a (shifted) view protects the whole base allocation since
    pytorch/pytorch#27366 / PR #27371 (recordStream is given storage().data_ptr()).
  * "forced deallocation" helper with Tensor.set_(): pasqal-io/emulators,
    emu_base/utils.py::deallocate_tensor (t.resize_(0); t.set_(source=<empty storage>)).
  * The logger itself (side-stream top-k of the last rows of each step's logits, with a
    bounded deque of row views kept for debug dumps) is a plausible pattern, no specific issue.

set_() on `logits` does not free anything: the row view in the logger's deque still owns the
storage.  The real free happens later, when the deque evicts the oldest view.
"""
import collections

import torch

DEV = torch.device("cuda", 0)
N, D, V = 2048, 1024, 8192           # logits 2048 x 8192 fp32 = 64 MiB (own allocator segment)
STEPS = 6


def deallocate_tensor(t):
    """Free t's memory even if other Python names still refer to it (pasqal-io/emulators)."""
    t.resize_(0)
    t.set_(source=torch.zeros(0, dtype=t.dtype, device=t.device).untyped_storage())


class AsyncTopKLogger:
    """Decodes the top-k tokens of the last rows of every step's logits on a side stream."""

    def __init__(self, history=2, k=5):
        self.stream = torch.cuda.Stream(DEV)
        self.rows = collections.deque(maxlen=history)   # recent row views, kept for dumps
        self.results = []
        self.k = k

    def log(self, logits):
        rows = logits[-4:]                              # shifted view into logits' storage
        self.stream.wait_stream(torch.cuda.current_stream(DEV))
        with torch.cuda.stream(self.stream):
            top = torch.topk(rows, self.k, dim=-1).indices     # side stream reads the view
        self.results.append(top)
        self.rows.append(rows)          # evicts the oldest view -> its base storage is freed

    def flush(self):
        torch.cuda.current_stream(DEV).wait_stream(self.stream)
        out = torch.stack(self.results).cpu()
        self.results.clear()
        return out


def train_step(x, w1, w2, logger):
    h = torch.tanh(x @ w1)                              # [N, D]
    logits = h @ w2                                     # [N, V], default stream
    score = logits.amax(dim=-1).mean()
    logger.log(logits)
    deallocate_tensor(logits)   # no free yet: the logger's deque still holds a view
    return score


def main():
    torch.manual_seed(0)
    xs = [torch.randn(N, D, device=DEV) for _ in range(STEPS)]
    w1 = torch.randn(D, D, device=DEV).div_(D ** 0.5)
    w2 = torch.randn(D, V, device=DEV).div_(D ** 0.5)
    logger = AsyncTopKLogger()
    scores = []
    for step in range(STEPS):
        scores.append(train_step(xs[step], w1, w2, logger))
    tops = logger.flush()
    torch.cuda.synchronize()
    print("top-k tokens", tuple(tops.shape), "score", round(torch.stack(scores).sum().item(), 3))


if __name__ == "__main__":
    main()
