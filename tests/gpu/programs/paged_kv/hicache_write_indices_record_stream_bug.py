# Source: sgl-project/sglang python/sglang/srt/managers/cache_controller.py,
# HiCacheController.start_writing(): pending write ops are merged (CacheOperation.
# merge_ops -> torch.cat of the nodes' device indices, allocated on the scheduler's
# stream), the backup runs on self.write_stream after start_event.wait(), and then
# `if device_indices.is_cuda: device_indices.record_stream(self.write_stream)`.
# This script drops that record_stream call (plausible regression of the real code).
# Plain torch: backup_from_device_all_layer = per-layer index_select (gather) on the
# write stream + non_blocking copy_ into a contiguous range of the pinned host pool.
#
# BUG: the merged device_indices tensor (allocated on the default stream) is read by
# index_select on write_stream and then freed with no record_stream(write_stream);
# the default stream re-allocates it (next merge) while the gather may still read it.
import torch

DEV = torch.device("cuda:0")
LAYERS, DEV_TOKENS, HOST_TOKENS = 4, 8192, 8192
HEADS, DIM, NODE_TOKENS = 8, 64, 128


class CacheOperation:
    def __init__(self, host_start, device_indices, node_id):
        self.host_start, self.device_indices, self.node_ids = host_start, device_indices, [node_id]

    @staticmethod
    def merge_ops(ops):
        merged = CacheOperation(ops[0].host_start,
                                torch.cat([op.device_indices for op in ops]), -1)
        merged.node_ids = [n for op in ops for n in op.node_ids]
        return merged


class HiCacheController:
    def __init__(self):
        self.device_kv = torch.zeros(LAYERS, DEV_TOKENS, 2, HEADS, DIM, device=DEV,
                                     dtype=torch.float16)
        self.host_kv = torch.zeros(LAYERS, HOST_TOKENS, 2, HEADS, DIM,
                                   dtype=torch.float16, pin_memory=True)
        self.write_stream = torch.cuda.Stream()
        self.write_queue, self.ack_write_queue = [], []
        self.host_cursor = 0

    def write(self, device_indices, node_id):
        op = CacheOperation(self.host_cursor, device_indices, node_id)
        self.host_cursor += len(device_indices)  # host pages are contiguous
        self.write_queue.append(op)

    def start_writing(self):
        if not self.write_queue:
            return
        op = CacheOperation.merge_ops(self.write_queue)
        self.write_queue.clear()
        device_indices, h0 = op.device_indices, op.host_start
        n = len(device_indices)
        start_event, finish_event = torch.cuda.Event(), torch.cuda.Event()
        start_event.record()
        with torch.cuda.stream(self.write_stream):
            start_event.wait(self.write_stream)
            for layer in range(LAYERS):  # backup_from_device_all_layer
                data = self.device_kv[layer].index_select(0, device_indices)
                self.host_kv[layer, h0:h0 + n].copy_(data, non_blocking=True)
            finish_event.record()
        self.ack_write_queue.append((finish_event, op.node_ids))


def main():
    torch.manual_seed(0)
    ctrl = HiCacheController()
    # token slots handed out by the device allocator (views of one persistent tensor)
    free_slots = torch.randperm(DEV_TOKENS, device=DEV)
    new_kv = torch.randn(LAYERS, NODE_TOKENS, 2, HEADS, DIM, device=DEV,
                         dtype=torch.float16)
    torch.cuda.synchronize()  # setup done before any side-stream work

    node_id = 0
    for it in range(6):
        nodes = []
        for _ in range(2):  # prefill two requests: write their KV (compute stream)
            slots = free_slots[node_id * NODE_TOKENS:(node_id + 1) * NODE_TOKENS]
            for layer in range(LAYERS):
                ctrl.device_kv[layer].index_copy_(0, slots, new_kv[layer])
            nodes.append((node_id, slots))
            node_id += 1
        for nid, slots in nodes:  # write-through to the host pool
            ctrl.write(slots, nid)
        ctrl.start_writing()
    for finish_event, _ in ctrl.ack_write_queue:
        finish_event.synchronize()
    torch.cuda.synchronize()
    print("backed-up nodes", sum(len(ids) for _, ids in ctrl.ack_write_queue),
          "host checksum", float(ctrl.host_kv[:, :ctrl.host_cursor].float().abs().sum()))


if __name__ == "__main__":
    main()
