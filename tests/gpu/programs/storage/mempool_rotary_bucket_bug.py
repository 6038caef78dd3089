# Source: NVIDIA/Megatron-LM
#   megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py
#   RotaryBucketAllocator: temporary all-gather buckets come from a small set
#   of global buffers (get_global_memory_buffer().get_tensor(...,
#   mem_alloc_context=...)); free() only moves the buffer id back to
#   idle_buffer, so the CUDA caching allocator never sees a free.
#   megatron/core/nccl_allocator.py: the buffers are created inside
#   torch.cuda.use_mem_pool(pool) (NCCL user-buffer MemPool).
# Pattern: all-gathers run on an ag side stream with one-unit prefetch; the
# compute (default) stream reads the bucket; free() recycles the buffer for
# the prefetch two units later, which the ag stream overwrites.
import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
DIM = 2048
UNITS = 6
BATCH = 256


class RotaryBucketAllocator:
    def __init__(self, name, pool, ag_stream):
        self.name = name
        self.pool = pool
        self.ag_stream = ag_stream
        self.num_global_buffer = 0
        self.idle_buffer = []      # [buffer_id]
        self.using_buffer = {}     # {bucket_id: buffer_id}
        self.global_buffers = {}   # {buffer_name: tensor}, lives for the whole run

    def _get_global_buffer(self, buffer_id, numel, dtype):
        name = f"{self.name}_{buffer_id}"
        if name not in self.global_buffers:
            with torch.cuda.use_mem_pool(self.pool):   # registered user-buffer pool
                self.global_buffers[name] = torch.empty(numel, dtype=dtype, device="cuda")
        return self.global_buffers[name]

    def allocate(self, bucket_id, numel, dtype):
        if bucket_id in self.using_buffer:
            return self._get_global_buffer(self.using_buffer[bucket_id], numel, dtype)
        if not self.idle_buffer:
            self.idle_buffer.append(self.num_global_buffer)
            self.num_global_buffer += 1
        buffer_id = self.idle_buffer.pop(0)
        self.using_buffer[bucket_id] = buffer_id
        return self._get_global_buffer(buffer_id, numel, dtype)

    def free(self, bucket_id):
        if bucket_id in self.using_buffer:
            self.idle_buffer.append(self.using_buffer.pop(bucket_id))


class FSDPUnit:
    def __init__(self, unit_id, shard):
        self.unit_id = unit_id
        self.shard = shard          # local shard (single GPU: the whole flat param)
        self.ag_event = None


def all_gather_unit(unit, allocator):
    bucket = allocator.allocate(unit.unit_id, unit.shard.numel(), unit.shard.dtype)
    with torch.cuda.stream(allocator.ag_stream):
        bucket.copy_(unit.shard)                     # stand-in for all_gather_into_tensor
        unit.ag_event = allocator.ag_stream.record_event()


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    shards = [torch.randn(DIM * DIM, device=dev) / DIM ** 0.5 for _ in range(UNITS)]
    x0 = torch.randn(BATCH, DIM, device=dev)

    ref = x0
    for s in shards:
        ref = torch.tanh(ref @ s.view(DIM, DIM))
    reference = ref.double().sum().item()
    torch.cuda.synchronize()

    pool = torch.cuda.MemPool()
    ag_stream = torch.cuda.Stream()
    allocator = RotaryBucketAllocator("fsdp_ag", pool, ag_stream)
    units = [FSDPUnit(i, s) for i, s in enumerate(shards)]

    x = x0
    with torch.no_grad():
        all_gather_unit(units[0], allocator)
        for i, unit in enumerate(units):
            if i + 1 < UNITS:
                all_gather_unit(units[i + 1], allocator)     # prefetch next unit
            torch.cuda.current_stream().wait_event(unit.ag_event)
            weight = allocator.allocate(unit.unit_id, unit.shard.numel(), unit.shard.dtype)
            torch.cuda._sleep(SLEEP_CYCLES)                  # compute before the weight read
            x = torch.tanh(x @ weight.view(DIM, DIM))
            allocator.free(unit.unit_id)
    checksum = x.double().sum().item()
    torch.cuda.synchronize()
    match = abs(checksum - reference) <= 1e-3 * max(1.0, abs(reference))
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
