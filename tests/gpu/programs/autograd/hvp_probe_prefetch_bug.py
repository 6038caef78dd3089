# Source: prefetcher structure of NVIDIA apex examples/imagenet/main_amp.py (data_prefetcher) and
#         Megvii-BaseDetection/YOLOX yolox/data/data_prefetcher.py (next(): wait_stream + record_stream);
#         Hutchinson Hessian-trace estimation with double backward as in PyHessian (pyhessian/hessian.py,
#         hessian_vector_product via torch.autograd.grad(grads, params, grad_outputs=v)).
# Pattern: the Rademacher probe vectors for the next Hessian-vector product are generated on a side
# stream while the current HVP runs. The probes are fed to the double backward as grad_outputs; the
# autograd engine assumes grad_outputs were produced on the stream current at the grad() call.
import torch
import torch.nn as nn

SLEEP = 20_000_000
dev = torch.device("cuda")
torch.manual_seed(0)


class RademacherPrefetcher:
    """Yields lists of +-1 probe tensors; the next list is generated on a side stream."""

    def __init__(self, shapes, n_probes, seed):
        self.shapes = shapes
        self.remaining = n_probes
        self.stream = torch.cuda.Stream()
        self.gen = torch.Generator(device=dev)
        self.gen.manual_seed(seed)
        self.next_probes = None
        self._preload()

    def _preload(self):
        if self.remaining == 0:
            self.next_probes = None
            return
        self.remaining -= 1
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP)  # probe generation lags behind the consumer
            self.next_probes = [
                torch.randint(0, 2, s, device=dev, generator=self.gen).float().mul_(2.0).sub_(1.0)
                for s in self.shapes
            ]

    def __iter__(self):
        return self

    def __next__(self):
        cur = torch.cuda.current_stream()
        probes = self.next_probes
        if probes is None:
            raise StopIteration
        for v in probes:
            v.record_stream(cur)  # allocated on self.stream, consumed and freed on cur
        self._preload()
        return probes


def hutchinson(model, x, y, probe_iter):
    params = list(model.parameters())
    loss = (model(x) - y).pow(2).mean()
    grads = torch.autograd.grad(loss, params, create_graph=True)
    estimates = []
    for probes in probe_iter:
        hv = torch.autograd.grad(grads, params, grad_outputs=probes, retain_graph=True)
        estimates.append(sum((h * v).sum() for h, v in zip(hv, probes)))
    return torch.stack(estimates)


model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1)).to(dev)
x = torch.randn(4096, 256, device=dev)
y = torch.randn(4096, 1, device=dev)
shapes = [tuple(p.shape) for p in model.parameters()]
N_PROBES, SEED = 3, 1234

est = hutchinson(model, x, y, RademacherPrefetcher(shapes, N_PROBES, SEED))
torch.cuda.synchronize()
checksum = est.double().sum().item()

# Reference: identical probes (same generator seed and call order), generated on the default stream.
g = torch.Generator(device=dev)
g.manual_seed(SEED)
ref_probes = [
    [torch.randint(0, 2, s, device=dev, generator=g).float().mul_(2.0).sub_(1.0) for s in shapes]
    for _ in range(N_PROBES)
]
reference = hutchinson(model, x, y, iter(ref_probes)).double().sum().item()

torch.cuda.synchronize()
match = abs(checksum - reference) <= 1e-4 * abs(reference) + 1e-5
print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")
