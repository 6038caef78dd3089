# Case dlpack_kmeans (BUG version)
# Plausible RAPIDS-style pattern (no single upstream issue found): PyTorch produces
# embeddings on its current stream, CuPy assigns them to k-means centroids on its own
# non-blocking stream. The legacy capsule exchange `cupy.from_dlpack(to_dlpack(t))`
# performs no stream handshake; CuPy documents for fromDlpack/toDlpack that "the user
# is responsible to ensure the Producer and the Consumer are operating on the same
# stream". The DLPack protocol handshake (pytorch/pytorch PR #57110, Tensor.__dlpack__
# (stream=...) records an event on torch's current stream and makes the consumer stream
# wait) is what `cupy.from_dlpack(tensor)` uses. Bug: the CuPy matmul reads the
# embedding buffer while torch may still be writing it (F.normalize) on its stream.
# The results go back with torch.from_dlpack(cupy_array) under `with stream:`, which
# does the handshake in the other direction (correct in both versions).
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.dlpack
import cupy


class Encoder(nn.Module):
    def __init__(self, d_in=256, d=128):
        super().__init__()
        self.fc1 = nn.Linear(d_in, 512)
        self.fc2 = nn.Linear(512, d)

    def forward(self, x):
        h = self.fc2(F.relu(self.fc1(x)))
        return F.normalize(h, dim=1)


class CupyKMeansAssigner:
    def __init__(self, k, d):
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            c = cupy.random.RandomState(0).standard_normal((k, d), dtype=cupy.float32)
            self.centroids = c / cupy.linalg.norm(c, axis=1, keepdims=True)
        self.stream.synchronize()

    def assign(self, emb_t):
        emb = cupy.from_dlpack(torch.utils.dlpack.to_dlpack(emb_t))  # no handshake
        with self.stream:
            scores = emb @ self.centroids.T
            labels = cupy.argmax(scores, axis=1)
            best = cupy.max(scores, axis=1)
            # torch's current stream waits on self.stream (CuPy's __dlpack__)
            labels_t = torch.from_dlpack(labels)
            best_t = torch.from_dlpack(best)
        return labels_t, best_t


@torch.no_grad()
def main():
    torch.manual_seed(0)
    device = torch.device('cuda', 0)
    k = 16
    encoder = Encoder().to(device).eval()
    assigner = CupyKMeansAssigner(k=k, d=128)
    counts = torch.zeros(k, dtype=torch.int64, device=device)
    sims = []
    for step in range(20):
        x = torch.randn(4096, 256, device=device)
        emb_t = encoder(x)
        labels_t, best_t = assigner.assign(emb_t)
        counts += torch.bincount(labels_t, minlength=k)
        sims.append(best_t.mean().item())  # per-step logging (host sync on torch stream)
    print('cluster sizes', counts.tolist())
    print(f'mean best cosine {sum(sims) / len(sims):.4f}')


if __name__ == '__main__':
    main()
