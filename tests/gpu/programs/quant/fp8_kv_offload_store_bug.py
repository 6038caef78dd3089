# Source: vllm-project/vllm, vllm/v1/kv_offload/worker/cpu_gpu.py SingleDirectionOffloadingHandler.transfer_async
#   (GPU->CPU store of KV blocks on a pooled CUDA stream via ops.swap_blocks, one end_event per job, polled with
#   end_event.query() in get_finished() and event.synchronize() in wait()), with an fp8 KV cache whose pages
#   carry per-token-head fp32 scales next to the fp8 data (like the fp8_ds_mla page layout).
#   ops.swap_blocks is emulated with per-block non_blocking copies into the pinned CPU blocks.
# Bug: transfer_async() for the GPU->CPU direction omits `stream.wait_stream(torch.cuda.current_stream())`
#   ("wait for model computation to finish before offloading"). The offload stream only waits for the previous
#   transfer, so its D2H copies read the KV pages (fp8 data and scales) of the blocks completed in this step
#   before the default stream's reshape_and_cache_fp8 (queued behind the forward pass) has written them; the CPU
#   copies hold stale pages. Race: default-stream writes of kv_caches[layer][block] (quantized K/V and scales) vs
#   offload-stream reads of the same pages (swap_blocks D2H).
# Fix: in transfer_async, when gpu_to_cpu, call stream.wait_stream(torch.cuda.current_stream()) before the copies.
from collections import deque
from dataclasses import dataclass

import torch

DEV = "cuda:0"
FP8_MAX = 448.0
BLOCK_SIZE = 16
NUM_KV_HEADS = 8
HEAD_DIM = 128
NUM_LAYERS = 4
NUM_GPU_BLOCKS = 32
NUM_CPU_BLOCKS = 32
BLOCKS_PER_STEP = 4
N_STEPS = 6
DATA_BYTES = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM  # fp8 payload of one K (or V) page
PAGE_BYTES = DATA_BYTES + BLOCK_SIZE * NUM_KV_HEADS * 4  # + one fp32 scale per token-head
FORWARD_CYCLES = 30_000_000  # the layers' attention/MLP that precede the cache writes


@dataclass
class Transfer:
    job_id: int
    stream: torch.cuda.Stream
    end_event: torch.cuda.Event


def quant_per_token_head(x):
    amax = x.float().abs().amax(dim=-1).clamp(min=1e-6)  # [T, H]
    scale = amax / FP8_MAX
    return (x.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def reshape_and_cache_fp8(key, value, kv_cache, block_ids):
    """Block-aligned chunked prefill: token t of the chunk goes to block_ids[t // BLOCK_SIZE]."""
    for i, x in enumerate((key, value)):
        q, s = quant_per_token_head(x)
        for n, blk in enumerate(block_ids):
            toks = slice(n * BLOCK_SIZE, (n + 1) * BLOCK_SIZE)
            page = kv_cache[blk, i]
            page[:DATA_BYTES].copy_(q[toks].view(torch.int8).reshape(-1))
            page[DATA_BYTES:].view(torch.float32).copy_(s[toks].reshape(-1))


def swap_blocks(src, dst, src_to_dst):
    for s, d in src_to_dst:
        dst[d].copy_(src[s], non_blocking=True)


class SingleDirectionOffloadingHandler:
    def __init__(self, gpu_tensors, cpu_tensors, gpu_to_cpu):
        self.src_tensors = gpu_tensors if gpu_to_cpu else cpu_tensors
        self.dst_tensors = cpu_tensors if gpu_to_cpu else gpu_tensors
        self.gpu_to_cpu = gpu_to_cpu
        self._transfer_events = {}
        self._transfers = deque()
        self._stream_pool = []
        self._event_pool = []

    def transfer_async(self, job_id, transfer_spec):
        src_blocks, dst_blocks = transfer_spec
        src_to_dst = list(zip(src_blocks, dst_blocks))
        stream = self._stream_pool.pop() if self._stream_pool else torch.cuda.Stream()
        end_event = self._event_pool.pop() if self._event_pool else torch.cuda.Event()
        if self._transfers:
            # assure job will start only after the previous one completes
            stream.wait_event(self._transfers[-1].end_event)
        with torch.cuda.stream(stream):
            for src_tensor, dst_tensor in zip(self.src_tensors, self.dst_tensors):
                swap_blocks(src_tensor, dst_tensor, src_to_dst)
            end_event.record(stream)
        self._transfer_events[job_id] = end_event
        self._transfers.append(Transfer(job_id, stream, end_event))
        return True

    def get_finished(self):
        done = []
        while self._transfers and self._transfers[0].end_event.query():
            t = self._transfers.popleft()
            done.append(t.job_id)
            self._stream_pool.append(t.stream)
            self._event_pool.append(t.end_event)
            del self._transfer_events[t.job_id]
        return done

    def wait(self, job_ids):
        for job_id in job_ids:
            event = self._transfer_events.get(job_id)
            if event is not None:
                event.synchronize()


@torch.no_grad()
def main():
    torch.manual_seed(0)
    tokens = BLOCKS_PER_STEP * BLOCK_SIZE
    kv_caches = [torch.zeros(NUM_GPU_BLOCKS, 2, PAGE_BYTES, dtype=torch.int8, device=DEV) for _ in range(NUM_LAYERS)]
    gpu_tensors = [kv.view(NUM_GPU_BLOCKS, 2 * PAGE_BYTES) for kv in kv_caches]
    cpu_tensors = [torch.zeros(NUM_CPU_BLOCKS, 2 * PAGE_BYTES, dtype=torch.int8, pin_memory=True)
                   for _ in range(NUM_LAYERS)]
    kv_in = torch.randn(N_STEPS, NUM_LAYERS, 2, tokens, NUM_KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    store = SingleDirectionOffloadingHandler(gpu_tensors, cpu_tensors, gpu_to_cpu=True)
    torch.cuda.synchronize()  # KV cache allocated and zeroed before serving starts

    finished, jobs, mapping = [], [], []
    for step in range(N_STEPS):
        gpu_blocks = [step * BLOCKS_PER_STEP + n for n in range(BLOCKS_PER_STEP)]
        cpu_blocks = [NUM_CPU_BLOCKS - 1 - b for b in gpu_blocks]
        torch.cuda._sleep(FORWARD_CYCLES)  # model forward for this scheduler step
        for layer in range(NUM_LAYERS):
            reshape_and_cache_fp8(kv_in[step, layer, 0], kv_in[step, layer, 1], kv_caches[layer], gpu_blocks)
        # connector: the blocks completed in this step are stored to CPU
        store.transfer_async(step, (gpu_blocks, cpu_blocks))
        jobs.append(step)
        mapping += list(zip(gpu_blocks, cpu_blocks))
        finished += store.get_finished()
    store.wait(set(jobs) - set(finished))

    # what the CPU tier now holds (pinned host memory, read after the jobs' end events)
    ok = True
    torch.cuda.synchronize()
    for layer in range(NUM_LAYERS):
        for g, c in mapping:
            ok &= torch.equal(cpu_tensors[layer][c], gpu_tensors[layer][g].cpu())
    print(f"stored blocks={len(mapping)} per layer, jobs={len(jobs)}")
    print(f"match={bool(ok)}")


if __name__ == "__main__":
    main()
