# Source: sglang python/sglang/srt/managers/cache_controller.py, HiCacheController.write()/start_writing()
#   (device->host write-through on write_stream, ack with start/finish events in ack_write_queue) and
#   load()/start_loading() (host->device load-back on load_stream, which waits only for the producer start_event
#   recorded on the forward stream, per-layer LayerDoneCounter events for the consumer), together with
#   mem_cache/hiradix_cache.py HiRadixCache.writing_check()/evict()/load_back() and the pinned host pool
#   MHATokenToKVPoolHost.kv_buffer [2, layer, token, head, dim] (layer_first layout).
# Bug: a node is treated as backed up as soon as its write-through is issued (the finish_event ack of
#   writing_check() is skipped), so its device copy is evicted and the next request sharing that prefix
#   load_back()s it. The H2D copies on load_stream read host pool slots that the D2H copies on write_stream
#   (stuck behind earlier write-through traffic) have not written yet: write_stream write vs load_stream read of
#   the same pinned kv_buffer bytes, no edge between the two streams.
# Fix: start_loading() makes load_stream wait for the finish_event of every write-through still in
#   ack_write_queue before it reads the host pool.
from dataclasses import dataclass

import torch

LAYERS, HEADS, HEAD_DIM = 4, 8, 64
DEVICE_SLOTS, HOST_SLOTS, PREFIX_LEN, NEW_TOKENS = 4096, 8192, 1024, 16


class MHATokenToKVPool:
    def __init__(self, size, device):
        self.k_buffer = [torch.zeros(size, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]
        self.v_buffer = [torch.zeros(size, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]
        self.free_pages = list(range(0, size, PREFIX_LEN))  # freed pages are appended at the end, like SGLang

    def alloc(self):
        start = self.free_pages.pop(0)
        return (start, start + PREFIX_LEN)

    def free(self, rng):
        self.free_pages.append(rng[0])


class MHATokenToKVPoolHost:
    def __init__(self, size):
        self.kv_buffer = torch.zeros(2, LAYERS, size, HEADS, HEAD_DIM, dtype=torch.bfloat16, pin_memory=True)
        self.next_free = 0

    def alloc(self, n):
        rng = (self.next_free, self.next_free + n)
        self.next_free += n
        return rng


@dataclass
class HiCacheAck:
    start_event: torch.cuda.Event
    finish_event: torch.cuda.Event
    node_ids: list


class HiCacheController:
    def __init__(self, device_pool, host_pool):
        self.device_pool, self.host_pool = device_pool, host_pool
        self.write_stream = torch.cuda.Stream()
        self.load_stream = torch.cuda.Stream()
        self.ack_write_queue = []
        self.layer_done_events = [torch.cuda.Event() for _ in range(LAYERS)]

    def write(self, device_rng, node_id):
        (d0, d1), host_rng = device_rng, self.host_pool.alloc(device_rng[1] - device_rng[0])
        h0, h1 = host_rng
        start_event, finish_event = torch.cuda.Event(), torch.cuda.Event()
        start_event.record()  # KV of this node has been produced on the forward stream
        self.write_stream.wait_event(start_event)
        with torch.cuda.stream(self.write_stream):
            torch.cuda._sleep(50_000_000)  # stand-in for the write-through backlog of earlier requests
            for layer in range(LAYERS):
                for kv, dev_buf in enumerate((self.device_pool.k_buffer[layer], self.device_pool.v_buffer[layer])):
                    self.host_pool.kv_buffer[kv, layer, h0:h1].copy_(dev_buf[d0:d1], non_blocking=True)
            finish_event.record()
        self.ack_write_queue.append(HiCacheAck(start_event, finish_event, [node_id]))
        return host_rng

    def start_loading(self, host_rng, device_rng):
        (h0, h1), (d0, d1) = host_rng, device_rng
        producer_start = torch.cuda.Event()
        producer_start.record()
        self.load_stream.wait_event(producer_start)
        for ack in self.ack_write_queue:  # host slots being loaded may still be in flight from write_stream
            self.load_stream.wait_event(ack.finish_event)
        with torch.cuda.stream(self.load_stream):
            for layer in range(LAYERS):
                for kv, dev_buf in enumerate((self.device_pool.k_buffer[layer], self.device_pool.v_buffer[layer])):
                    dev_buf[d0:d1].copy_(self.host_pool.kv_buffer[kv, layer, h0:h1], non_blocking=True)
                self.layer_done_events[layer].record()


class TreeNode:
    def __init__(self, node_id, key):
        self.id, self.key, self.value, self.host_value, self.backuped = node_id, key, None, None, False


class HiRadixCache:
    def __init__(self, controller, device_pool):
        self.controller, self.device_pool, self.nodes = controller, device_pool, {}

    def insert(self, key, device_rng):
        node = TreeNode(len(self.nodes), key)
        node.value = device_rng
        node.host_value = self.controller.write(device_rng, node.id)  # write_through policy
        node.backuped = True  # optimistic: writing_check() would only set this once finish_event completed
        self.nodes[key] = node
        return node

    def evict(self, node):
        if node.backuped:
            self.device_pool.free(node.value)
            node.value = None

    def load_back(self, node):
        device_rng = self.device_pool.alloc()
        self.controller.start_loading(node.host_value, device_rng)
        node.value = device_rng
        return device_rng


def attention(q, pool, rng, layer):
    k = pool.k_buffer[layer][rng[0]:rng[1]].float()
    v = pool.v_buffer[layer][rng[0]:rng[1]].float()
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM ** 0.5
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def main():
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    dev_pool, host_pool = MHATokenToKVPool(DEVICE_SLOTS, device), MHATokenToKVPoolHost(HOST_SLOTS)
    controller = HiCacheController(dev_pool, host_pool)
    tree = HiRadixCache(controller, dev_pool)
    w_kv = torch.randn(LAYERS, 2, HEADS * HEAD_DIM, HEADS * HEAD_DIM, device=device) / (HEADS * HEAD_DIM) ** 0.5

    # request A: prefill of a shared system prompt, KV written into the device pool, then written through
    prefix_rng = dev_pool.alloc()
    x = torch.randn(PREFIX_LEN, HEADS * HEAD_DIM, device=device)
    for layer in range(LAYERS):
        dev_pool.k_buffer[layer][prefix_rng[0]:prefix_rng[1]] = (x @ w_kv[layer, 0]).view(PREFIX_LEN, HEADS, HEAD_DIM).bfloat16()
        dev_pool.v_buffer[layer][prefix_rng[0]:prefix_rng[1]] = (x @ w_kv[layer, 1]).view(PREFIX_LEN, HEADS, HEAD_DIM).bfloat16()
    node = tree.insert("system-prompt", prefix_rng)
    old_rng = node.value
    tree.evict(node)  # GPU memory pressure: evict the (supposedly) backed-up prefix

    # request B hits the prefix on host: load it back layer by layer and attend over it
    new_rng = tree.load_back(node)
    q = torch.randn(NEW_TOKENS, HEADS, HEAD_DIM, device=device)
    outs = []
    for layer in range(LAYERS):
        torch.cuda.current_stream().wait_event(controller.layer_done_events[layer])
        outs.append(attention(q, dev_pool, new_rng, layer))

    torch.cuda.synchronize()
    refs = [attention(q, dev_pool, old_rng, layer) for layer in range(LAYERS)]  # old slots were never reused
    match = all(torch.allclose(o, r, atol=1e-4, rtol=1e-4) for o, r in zip(outs, refs))
    print("loaded %d tokens x %d layers, out norm %.4f" % (PREFIX_LEN, LAYERS, sum(o.norm().item() for o in outs)))
    print("match=%s" % match)


if __name__ == "__main__":
    main()
