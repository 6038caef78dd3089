# Source: plausible pattern (semantic search service: torch embedding model on a dedicated
# torch stream, brute-force nearest-neighbour search in CuPy on its own stream, the two
# synchronised with a cupy.cuda.Event recorded on a cupy.cuda.ExternalStream that wraps
# the torch stream).  The bug: the ExternalStream is built from torch.cuda.current_stream()
# *after* leaving `with torch.cuda.stream(self.stream)`, so it wraps torch's default stream
# (cuda_stream == 0, the legacy default stream) instead of the encoder stream that computes
# `emb`.  The event therefore completes as soon as the default stream's work (the input
# upload) is done, and the CuPy index stream's GEMM reads `emb` (zero-copy view via
# cupy.asarray) while the encoder stream may still be writing it (device-device race).
# Fix (_fixed.py): record the event on cupy.cuda.ExternalStream(self.stream.cuda_stream).
import numpy
import torch
import cupy

B = 4096        # queries per batch
D_IN = 256
D = 128         # embedding size
M = 8192        # database size
ITERS = 10
SPIN_CYCLES = 30_000_000  # ~15 ms: stands in for a bigger encoder


class TorchEncoder:
    def __init__(self):
        self.stream = torch.cuda.Stream()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(D_IN, 256), torch.nn.GELU(), torch.nn.Linear(256, D)).cuda().eval()

    @torch.no_grad()
    def encode(self, x, busy=True):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            if busy:
                torch.cuda._sleep(SPIN_CYCLES)
            emb = torch.nn.functional.normalize(self.net(x), dim=1)
        x.record_stream(self.stream)
        ready = cupy.cuda.Event(disable_timing=True)
        # BUG: torch's current stream here is the default stream, not self.stream.
        ready.record(cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream))
        return emb, ready


class CupyIndex:
    def __init__(self, db_host):
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.db = cupy.asarray(db_host)
        self.stream.synchronize()

    def search(self, emb_t, ready):
        self.stream.wait_event(ready)
        with self.stream:
            q = cupy.asarray(emb_t)       # zero-copy view (CAI v2: no implicit sync)
            scores = q @ self.db.T        # (B, M)
            best = scores.argmax(axis=1)
            best_score = scores.max(axis=1).sum(dtype=cupy.float64)
        emb_t.record_stream(torch.cuda.ExternalStream(self.stream.ptr))
        return best, best_score


def main():
    torch.manual_seed(0)
    rng = numpy.random.default_rng(5)
    db = rng.standard_normal((M, D), dtype=numpy.float32)
    db /= numpy.linalg.norm(db, axis=1, keepdims=True)
    queries = [rng.standard_normal((B, D_IN), dtype=numpy.float32) for _ in range(ITERS)]

    enc = TorchEncoder()
    index = CupyIndex(db)

    # warm-up (cuBLAS handles, CuPy kernels), host-synchronised
    we, wr = enc.encode(torch.zeros(8, D_IN, device='cuda'), busy=False)
    torch.cuda.synchronize()
    index.search(we, wr)
    cupy.cuda.Device(0).synchronize()
    del we, wr

    results = []
    for i in range(ITERS):
        x = torch.from_numpy(queries[i]).cuda()
        emb, ready = enc.encode(x)
        results.append(index.search(emb, ready))
        del x, emb

    torch.cuda.synchronize()
    cupy.cuda.Device(0).synchronize()

    checksum = sum(float(s) for _, s in results)
    ref = 0.0
    agree = 0
    db_t = torch.from_numpy(db).cuda()
    with torch.no_grad():
        for i in range(ITERS):
            e = torch.nn.functional.normalize(enc.net(torch.from_numpy(queries[i]).cuda()), dim=1)
            sc = e @ db_t.T
            ref += sc.max(dim=1).values.sum(dtype=torch.float64).item()
            agree += int((torch.from_dlpack(results[i][0]) == sc.argmax(dim=1)).sum().item())
    torch.cuda.synchronize()
    ok = agree >= ITERS * B - (ITERS * B) // 1000 and abs(checksum - ref) <= 1e-5 * abs(ref)
    print(f'checksum={checksum:.6f} reference={ref:.6f} argmax_agree={agree}/{ITERS * B} match={ok}')


if __name__ == '__main__':
    main()
