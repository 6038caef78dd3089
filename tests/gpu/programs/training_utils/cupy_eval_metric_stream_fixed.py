# Case: cupy_eval_metric_stream (FIXED version)
# Source: plausible pattern. An evaluation loop computes a confusion matrix with CuPy on
# a side stream (a torch.cuda.Stream wrapped with cupy.cuda.ExternalStream) using
# zero-copy cupy.asarray(tensor). PyTorch exports __cuda_array_interface__ version 2
# (torch/_tensor.py), which carries no "stream" key, so CuPy does not synchronize with the
# producer (the CAI v3 stream semantics are in numba/numba PR #5162 and cupy/cupy PR
# #4357); ordering is entirely the caller's job.
# Fix: metric_stream.wait_stream(default) before the CuPy kernels, so they read the
# logits only after the model has written them.
import cupy as cp
import torch
import torch.nn as nn

DEV = torch.device("cuda:0")


class CupyConfusionMatrix:
    def __init__(self, n_cls):
        self.n_cls = n_cls
        self.stream = torch.cuda.Stream(device=DEV)
        self.cp_stream = cp.cuda.ExternalStream(self.stream.cuda_stream)
        with self.cp_stream:
            self.cm = cp.zeros((n_cls, n_cls), dtype=cp.float32)
            self.classes = cp.arange(n_cls, dtype=cp.int64)

    def update(self, logits, target):
        self.stream.wait_stream(torch.cuda.current_stream())  # FIX: fork edge
        with self.cp_stream:
            lg = cp.asarray(logits.detach())  # zero-copy view of the torch buffer
            tg = cp.asarray(target)
            pred = cp.argmax(lg, axis=1)
            t_onehot = (tg[:, None] == self.classes[None, :]).astype(cp.float32)
            p_onehot = (pred[:, None] == self.classes[None, :]).astype(cp.float32)
            self.cm += t_onehot.T @ p_onehot  # rows: target, cols: prediction
        # join: the caller may free logits / target afterwards
        torch.cuda.current_stream().wait_stream(self.stream)

    def compute(self):
        torch.cuda.synchronize()
        cm = cp.asnumpy(self.cm)
        acc = cm.trace() / max(cm.sum(), 1)
        return float(acc), cm


def main():
    torch.manual_seed(0)
    n_cls = 32
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, n_cls)).to(DEV).eval()
    g = torch.Generator().manual_seed(13)
    data = [(torch.randn(2048, 256, generator=g).to(DEV),
             torch.randint(0, n_cls, (2048,), generator=g).to(DEV)) for _ in range(8)]
    metric = CupyConfusionMatrix(n_cls)
    torch.cuda.synchronize()  # setup done
    with torch.no_grad():
        for x, y in data:
            logits = model(x)  # written on the default stream
            metric.update(logits, y)
    acc, cm = metric.compute()
    print("accuracy %.4f over %d samples" % (acc, int(cm.sum())))


if __name__ == "__main__":
    main()
