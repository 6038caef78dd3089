# Source: plausible pattern modelled on streaming-output / detokenization
# threads in LLM servers (vLLM's async output processing, SGLang's overlap
# scheduler with its copy_done event feeding the detokenizer, TensorRT-LLM's
# pinned decoder-output buffers): the decode loop copies each step's sampled
# token ids into a ring of pinned host buffers with non_blocking=True and hands
# the slot, together with a CUDA event recorded after the copy, to a
# detokenizer thread, which gives the slot back once it has read it.
#
# Race (host-device, read-after-write, across threads): the detokenizer thread
# reads pinned_ring[slot].tolist() without waiting for the event, so it can read
# the slot's previous contents while the D2H copy (queued behind the step's
# forward on the default stream) has not written it yet.
# Fix: ready.synchronize() in the detokenizer thread before reading the slot.
import queue
import threading

import torch
import torch.nn as nn

DEV = "cuda:0"
V, H, B, STEPS, RING = 4096, 1024, 128, 24, 4
SLEEP_CYCLES = 2_000_000  # ~1 ms GPU busy-wait: each decode step is long
VOCAB = [f"<t{i}>" for i in range(V)]


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.mlp = nn.Sequential(nn.Linear(H, H), nn.GELU(), nn.Linear(H, H))
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, ids):
        return self.lm_head(self.mlp(self.embed(ids)))


class Detokenizer(threading.Thread):
    def __init__(self, ring):
        super().__init__(daemon=True)
        self.ring = ring
        self.inbox = queue.Queue()
        self.free_slots = queue.Queue()
        for i in range(len(ring)):
            self.free_slots.put(i)
        self.texts = [[] for _ in range(B)]

    def run(self):
        while True:
            item = self.inbox.get()
            if item is None:
                return
            slot, ready = item
            # FIX: wait until the D2H copy into this slot has completed.
            ready.synchronize()
            ids = self.ring[slot].tolist()
            self.free_slots.put(slot)  # the decode loop may now copy into it again
            for r, t in enumerate(ids):
                self.texts[r].append(VOCAB[t % V])


@torch.inference_mode()
def main():
    torch.manual_seed(0)
    model = TinyLM().to(DEV).eval()
    noise = torch.randn(STEPS, B, V, device=DEV)  # per-step sampling noise
    ring = [torch.zeros(B, dtype=torch.long).pin_memory() for _ in range(RING)]
    detok = Detokenizer(ring)
    detok.start()

    tokens = torch.randint(0, V, (B,), device=DEV)
    for step in range(STEPS):
        torch.cuda._sleep(SLEEP_CYCLES)
        logits = model(tokens)
        tokens = (logits + noise[step]).argmax(dim=-1)
        slot = detok.free_slots.get()
        ring[slot].copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        detok.inbox.put((slot, ready))
    detok.inbox.put(None)
    detok.join()
    torch.cuda.synchronize()

    checksum = 0
    for r, pieces in enumerate(detok.texts):
        text = "".join(pieces)
        checksum = (checksum * 131 + sum((i + 1) * ord(c) for i, c in enumerate(text))) % (1 << 61)
    print(f"detok_thread_pinned_ring checksum: {checksum}")


if __name__ == "__main__":
    main()
