# Case dlpack_kmeans (FIXED version)
# Plausible RAPIDS-style pattern. Fix: import through the DLPack protocol while CuPy's
# stream is current: `cupy.from_dlpack(emb_t)` calls emb_t.__dlpack__(stream=<CuPy
# stream ptr>), and torch (pytorch/pytorch PR #57110) records an event on its current
# stream and makes the CuPy stream wait on it, so the matmul is ordered after the
# F.normalize that wrote the embeddings. No host synchronization is added.
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
        with self.stream:
            emb = cupy.from_dlpack(emb_t)  # FIX: protocol handshake, self.stream waits
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
