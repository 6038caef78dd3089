# Structure: SGLang HiCache load-back (python/sglang/srt/managers/cache_controller.py:
# LayerLoadingEvent / LayerDoneCounter / HiCacheController.start_loading) -
# host->device KV copies run layer by layer on load_stream, each layer records
# its own event, and the attention of layer i waits (wait_until(i)) only for the
# event of layer i; device_indices get record_stream(load_stream) ("We must save
# the host indices and device indices here ...").  Plausible pattern, not a
# reported issue.  FIXED: the batch's consumer index is the producer index
# returned by start_loading() for this very load, so layer i's attention waits
# on the event recorded after layer i's host->device copy.
import torch

DEV = torch.device("cuda:0")
LAYERS, HEAD_DIM, PREFIX, HOST_SIZE, DEV_SIZE, NUM_STEPS = 4, 256, 256, 4096, 4096, 6


class LayerLoadingEvent:
    def __init__(self):
        self.load_events = [torch.cuda.Event() for _ in range(LAYERS)]

    def complete(self, layer):
        self.load_events[layer].record()

    def wait(self, layer):
        torch.cuda.current_stream().wait_event(self.load_events[layer])


class LayerDoneCounter:
    def __init__(self, num_counters=3):
        self.events = [LayerLoadingEvent() for _ in range(num_counters)]
        self.producer_index, self.consumer_index = -1, -1

    def update_producer(self):
        self.producer_index = (self.producer_index + 1) % len(self.events)
        finish = self.events[self.producer_index].load_events[-1]
        if not finish.query():  # slot must be free before it is reused
            finish.synchronize()
        return self.producer_index

    def set_consumer(self, index):
        self.consumer_index = index

    def wait_until(self, layer):
        if self.consumer_index < 0:
            return
        self.events[self.consumer_index].wait(layer)


class KVPools:
    def __init__(self, counter):
        g = torch.Generator().manual_seed(0)
        self.host_k = [torch.randn(HOST_SIZE, HEAD_DIM, generator=g).pin_memory() for _ in range(LAYERS)]
        self.dev_k = [torch.zeros(DEV_SIZE, HEAD_DIM, device=DEV) for _ in range(LAYERS)]
        self.layer_transfer_counter = counter

    def get_key_buffer(self, layer):
        self.layer_transfer_counter.wait_until(layer)
        return self.dev_k[layer]


class HiCacheController:
    def __init__(self, pools, counter):
        self.pools, self.layer_done_counter = pools, counter
        self.load_stream = torch.cuda.Stream()
        self.load_queue = []

    def load(self, host_start, device_indices):
        self.load_queue.append((host_start, device_indices))

    def start_loading(self):
        producer_id = self.layer_done_counter.update_producer()
        producer_event = self.layer_done_counter.events[producer_id]
        start_event = torch.cuda.Event()
        start_event.record()
        host_start, device_indices = self.load_queue.pop(0)
        with torch.cuda.stream(self.load_stream):
            start_event.wait(self.load_stream)
            for i in range(LAYERS):
                src = self.pools.host_k[i][host_start:host_start + PREFIX].to(DEV, non_blocking=True)
                self.pools.dev_k[i].index_copy_(0, device_indices, src)
                producer_event.complete(i)
            device_indices.record_stream(self.load_stream)
        return producer_id


class ScheduleBatch:
    def __init__(self, kv_start, q):
        # Pages of a request are contiguous here: prefix loaded from host
        # cache at [kv_start, kv_start+PREFIX), new token at kv_start+PREFIX.
        self.kv_start, self.kv_end, self.q = kv_start, kv_start + PREFIX + 1, q
        self.hicache_consumer_index = -1


def forward(batch, pools, wq):
    h, s, e = batch.q, batch.kv_start, batch.kv_end
    for i in range(LAYERS):
        k_buf = pools.get_key_buffer(i)
        k_buf[e - 1:e] = h                                          # new token KV
        k = k_buf[s:e]                                              # [PREFIX+1, D]
        attn = torch.softmax(h @ k.T / HEAD_DIM ** 0.5, dim=-1)
        h = torch.tanh((attn @ k) @ wq[i])
    return h


def main():
    counter = LayerDoneCounter()
    pools = KVPools(counter)
    ctrl = HiCacheController(pools, counter)
    g = torch.Generator(device=DEV).manual_seed(1)
    wq = [torch.randn(HEAD_DIM, HEAD_DIM, device=DEV, generator=g) * 0.1 for _ in range(LAYERS)]
    qs = torch.randn(NUM_STEPS, 1, HEAD_DIM, device=DEV, generator=g)
    torch.cuda.synchronize()
    outs = []
    for step in range(NUM_STEPS):  # each step: one request whose prefix hits host cache
        base = step * (PREFIX + 1)
        prefix_indices = torch.arange(base, base + PREFIX, device=DEV)
        batch = ScheduleBatch(base, qs[step])
        ctrl.load(host_start=step * PREFIX, device_indices=prefix_indices)
        batch.hicache_consumer_index = ctrl.start_loading()  # FIX
        counter.set_consumer(batch.hicache_consumer_index)
        outs.append(forward(batch, pools, wq))
    torch.cuda.synchronize()
    print("outputs:", torch.cat(outs).shape, float(torch.cat(outs).abs().sum()))


if __name__ == "__main__":
    main()
