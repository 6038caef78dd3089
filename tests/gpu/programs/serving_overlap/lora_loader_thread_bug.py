# Source: plausible pattern modelled on multi-LoRA serving with asynchronous
# adapter loading: stacked adapter slots as in vLLM (vllm/lora/models.py,
# LoRAModelManager.activate_adapter copying an adapter into a slot of
# lora_a_stacked / lora_b_stacked, Punica-style per-token slot indices) and
# S-LoRA / SGLang's LoRA memory pool, with a background loader thread that
# copies an adapter's pinned host weights into a free GPU slot on its own
# stream and then flags the adapter as ready.
#
# Race (device-device, read-after-write, across threads): the loader thread
# enqueues the H2D copies into lora_a_stacked[slot] / lora_b_stacked[slot] on its
# load stream and immediately sets the handle's threading.Event; the serving
# thread wakes up and runs the batch on the default stream, gathering per-token
# adapter weights with lora_a_stacked[token_slots] / lora_b_stacked[token_slots],
# with no CUDA ordering edge to the load stream, so the gather can read the
# previous adapter (or zeros) from that slot.
# Fix: the serving thread makes its stream wait on the CUDA event the loader
# recorded after the copies (torch.cuda.current_stream().wait_event(h.copied)).
import queue
import threading

import torch

DEV = "cuda:0"
H, RANK, NUM_SLOTS, NUM_ADAPTERS, T, BATCHES = 1024, 16, 3, 6, 512, 12
SLEEP_CYCLES = 2_000_000  # ~1 ms GPU busy-wait: the H2D link is busy


class LoadHandle:
    def __init__(self):
        self.enqueued = threading.Event()  # host side: copies have been issued
        self.copied = torch.cuda.Event()  # device side: copies have finished


class AdapterLoader(threading.Thread):
    def __init__(self, host_adapters, lora_a_stacked, lora_b_stacked):
        super().__init__(daemon=True)
        self.requests = queue.Queue()
        self.host_adapters = host_adapters
        self.lora_a_stacked = lora_a_stacked
        self.lora_b_stacked = lora_b_stacked

    def submit(self, adapter_id, slot, slot_free):
        handle = LoadHandle()
        self.requests.put((adapter_id, slot, slot_free, handle))
        return handle

    def run(self):
        torch.cuda.set_device(0)
        self.load_stream = torch.cuda.Stream()
        while True:
            item = self.requests.get()
            if item is None:
                return
            adapter_id, slot, slot_free, handle = item
            a_cpu, b_cpu = self.host_adapters[adapter_id]
            with torch.cuda.stream(self.load_stream):
                # batches already queued on the default stream may still read the old adapter
                self.load_stream.wait_event(slot_free)
                torch.cuda._sleep(SLEEP_CYCLES)
                self.lora_a_stacked[slot].copy_(a_cpu, non_blocking=True)
                self.lora_b_stacked[slot].copy_(b_cpu, non_blocking=True)
                handle.copied.record()
            handle.enqueued.set()


class LoRAManager:
    def __init__(self, loader):
        self.loader = loader
        self.slot_of = {}  # adapter id -> slot
        self.lru = []  # adapter ids, least recently used first

    def prepare(self, adapter_ids):
        handles = []
        for a in adapter_ids:
            if a in self.slot_of:
                self.lru.remove(a)
                self.lru.append(a)
                continue
            if len(self.slot_of) < NUM_SLOTS:
                slot = len(self.slot_of)
            else:
                victim = next(x for x in self.lru if x not in adapter_ids)
                self.lru.remove(victim)
                slot = self.slot_of.pop(victim)
            slot_free = torch.cuda.Event()
            slot_free.record()  # after every batch already launched on this stream
            handles.append(self.loader.submit(a, slot, slot_free))
            self.slot_of[a] = slot
            self.lru.append(a)
        for h in handles:
            h.enqueued.wait()
            # BUG: only the host-side flag is awaited; the default stream has no
            # ordering edge to the loader's H2D copies.
        return [self.slot_of[a] for a in adapter_ids]


def lora_linear(x, w_base, token_slots, lora_a_stacked, lora_b_stacked):
    y = x @ w_base
    a = lora_a_stacked[token_slots]  # [T, RANK, H], gathered by slot index
    b = lora_b_stacked[token_slots]  # [T, H, RANK]
    xa = torch.bmm(a, x.unsqueeze(-1))  # [T, RANK, 1]
    return y + torch.bmm(b, xa).squeeze(-1)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    host_adapters = [
        ((torch.randn(RANK, H) * 0.05).pin_memory(), (torch.randn(H, RANK) * 0.05).pin_memory())
        for _ in range(NUM_ADAPTERS)
    ]
    lora_a_stacked = torch.zeros(NUM_SLOTS, RANK, H, device=DEV)
    lora_b_stacked = torch.zeros(NUM_SLOTS, H, RANK, device=DEV)
    w_base = torch.randn(H, H, device=DEV) / H ** 0.5
    xs = torch.randn(BATCHES, T, H, device=DEV)
    acc = torch.zeros((), dtype=torch.float64, device=DEV)

    loader = AdapterLoader(host_adapters, lora_a_stacked, lora_b_stacked)
    loader.start()
    manager = LoRAManager(loader)
    for i in range(BATCHES):
        adapters = [(2 * i) % NUM_ADAPTERS, (2 * i + 1) % NUM_ADAPTERS]
        s0, s1 = manager.prepare(adapters)
        token_slots = torch.cat([
            torch.full((T // 2,), s0, dtype=torch.long, device=DEV),
            torch.full((T - T // 2,), s1, dtype=torch.long, device=DEV),
        ])
        y = lora_linear(xs[i], w_base, token_slots, lora_a_stacked, lora_b_stacked)
        acc += y.double().abs().sum() * (i + 1)
    loader.requests.put(None)
    loader.join()
    torch.cuda.synchronize()
    print(f"lora_loader_thread checksum: {acc.item():.6f}")


if __name__ == "__main__":
    main()
