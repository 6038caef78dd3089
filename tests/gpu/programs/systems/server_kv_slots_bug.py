"""Multi-client inference server: one request thread per client, each thread on
its own CUDA stream, all sharing read-only weights and a fixed pool of KV slots.

Modeled on: vllm-project/vllm issue #47282 / PR #47291 (a KV block freed by one
request is reused by another stream while the previous request's attention may
still read it: cross-stream write-after-read) and microsoft/onnxruntime PR #5415
(per-thread streams: a buffer "freed" on the host is handed to another thread
whose stream is not ordered after the first one).  Self-contained re-creation.

BUG: the worker calls pool.release(slot) after leaving its
`with torch.cuda.stream(...)` block, so the "slot free" event is recorded on the
thread's default stream (which has no work) instead of the request stream.  The
next owner waits on that event, which orders it after nothing.
"""
import threading

import torch

DEV = torch.device("cuda:0")
NUM_SLOTS = 2
NUM_CLIENTS = 3  # more clients than slots: the third one must reuse a slot
MAX_LEN = 64
HID = 256
PROMPT = 32
DECODE = 8


class TinyDecoder:
    """Shared read-only weights: a single attention head and an output proj."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        s = HID ** -0.5
        self.wq = (torch.randn(HID, HID, generator=g) * s).to(DEV)
        self.wk = (torch.randn(HID, HID, generator=g) * s).to(DEV)
        self.wv = (torch.randn(HID, HID, generator=g) * s).to(DEV)
        self.wo = (torch.randn(HID, HID, generator=g) * s).to(DEV)

    def attend(self, h, kv, length):
        q = h @ self.wq
        k = kv[0, :length]
        v = kv[1, :length]
        p = torch.softmax(q @ k.T * HID ** -0.5, dim=-1)
        return torch.tanh((p @ v) @ self.wo) + h

    def prefill(self, x, kv):
        kv[0, :PROMPT] = x @ self.wk
        kv[1, :PROMPT] = x @ self.wv
        return self.attend(x[-1:], kv, PROMPT)

    def decode_step(self, h, kv, pos):
        kv[0, pos:pos + 1] = h @ self.wk
        kv[1, pos:pos + 1] = h @ self.wv
        return self.attend(h, kv, pos + 1)


class KVSlotPool:
    """Fixed pool of per-request KV buffers handed out to request threads."""

    def __init__(self, n):
        self.kv = torch.zeros(n, 2, MAX_LEN, HID, device=DEV)
        self.free = list(range(n))
        self.last_use = [None] * n
        self.cv = threading.Condition()

    def acquire(self):
        with self.cv:
            while not self.free:
                if not self.cv.wait(timeout=60):
                    raise RuntimeError("no KV slot freed within 60 s")
            slot = self.free.pop(0)
            return slot, self.last_use[slot]

    def release(self, slot):
        ev = torch.cuda.Event()
        ev.record()  # records on the *calling thread's current* stream
        with self.cv:
            self.last_use[slot] = ev
            self.free.append(slot)
            self.cv.notify()


class RequestWorker(threading.Thread):
    def __init__(self, cid, model, pool, results):
        super().__init__(name=f"client-{cid}", daemon=True)
        self.cid, self.model, self.pool, self.results = cid, model, pool, results

    def run(self):
        stream = torch.cuda.Stream(device=DEV)
        gen = torch.Generator(device=DEV).manual_seed(100 + self.cid)
        out_host = torch.empty(DECODE, HID, pin_memory=True)
        slot, prev_done = self.pool.acquire()
        with torch.cuda.stream(stream):
            if prev_done is not None:
                stream.wait_event(prev_done)
            kv = self.pool.kv[slot]
            x = torch.randn(PROMPT, HID, device=DEV, generator=gen)
            h = self.model.prefill(x, kv)
            outs = []
            for t in range(DECODE):
                h = self.model.decode_step(h, kv, PROMPT + t)
                outs.append(h)
            out_host.copy_(torch.cat(outs), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self.pool.release(slot)  # BUG: outside the stream context
        self.results[self.cid] = (out_host, done)


def main():
    torch.manual_seed(0)
    model = TinyDecoder()
    pool = KVSlotPool(NUM_SLOTS)
    torch.cuda.synchronize()  # weights and pool are ready before serving
    results = {}
    workers = [RequestWorker(c, model, pool, results) for c in range(NUM_CLIENTS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    total = 0.0
    for cid in sorted(results):
        out_host, done = results[cid]
        done.synchronize()
        total += float(out_host.abs().sum())
    print(f"served {len(results)} requests, checksum {total:.3f}")


if __name__ == "__main__":
    main()
