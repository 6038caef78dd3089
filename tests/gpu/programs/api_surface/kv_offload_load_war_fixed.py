# Source: vllm-project/vllm vllm/v1/kv_offload/worker/cpu_gpu.py -- SingleDirectionOffloadingHandler.transfer_async /
#   get_finished / wait (a pooled torch.cuda.Stream per transfer, torch.Event(enable_timing=True) start/end events,
#   `stream.wait_event(last_event)` to keep transfers in order, end_event.query() polling and
#   start_event.elapsed_time(end_event) for transfer stats).  Only the GPU->CPU direction waits for the compute
#   stream (`if self.gpu_to_cpu: stream.wait_stream(torch.cuda.current_stream())`, added by vllm#31341); the
#   CPU->GPU load path has the write-after-read hazard reported for the simple offload connector in vllm#47282.
# Bug: request A's last decode step (default stream, queued behind earlier work) still reads its KV blocks 2,3 when
#   the scheduler, which runs ahead of the GPU, frees them and hands them to request B, whose prefix is loaded from
#   the CPU cache into blocks 2,3.  The load's H2D copies (pooled transfer stream, write gpu_kv[2:4]) do not wait for
#   the compute stream: device-device race (WAR) on the GPU KV cache blocks; A's attention reads B's KV.
# Fix: transfer_async makes the transfer stream wait for the current (compute) stream in both directions.
import time
from collections import deque
from dataclasses import dataclass

import torch

ATTN_CYCLES = 30_000_000  # a large decode batch in flight on the compute stream
NUM_GPU_BLOCKS, NUM_CPU_BLOCKS, BLOCK_ELEMS = 8, 16, 16 * 8 * 128  # block_size x heads x head_dim


@dataclass
class Transfer:
    job_id: int
    stream: torch.cuda.Stream
    start_event: torch.Event
    end_event: torch.Event
    num_bytes: int


class SingleDirectionOffloadingHandler:
    def __init__(self, gpu_tensor, cpu_tensor, gpu_to_cpu):
        self.src_tensor = gpu_tensor if gpu_to_cpu else cpu_tensor
        self.dst_tensor = cpu_tensor if gpu_to_cpu else gpu_tensor
        self.gpu_to_cpu = gpu_to_cpu
        self.block_bytes = gpu_tensor[0].numel() * gpu_tensor.element_size()
        self._transfer_events = {}
        self._transfers = deque()
        self._stream_pool = []
        self._event_pool = []

    def transfer_async(self, job_id, src_blocks, dst_blocks):
        stream = self._stream_pool.pop() if self._stream_pool else torch.cuda.Stream()
        start_event = self._event_pool.pop() if self._event_pool else torch.Event(enable_timing=True)
        end_event = self._event_pool.pop() if self._event_pool else torch.Event(enable_timing=True)
        # wait for model computation to finish: before offloading (the KV must be written) and before loading
        # (the destination blocks' previous owner may still be reading them on the compute stream)
        stream.wait_stream(torch.cuda.current_stream())
        if self._transfers:
            # assure job will start only after the previous one completes
            stream.wait_event(self._transfers[-1].end_event)
        with torch.cuda.stream(stream):
            start_event.record(stream)
            for src, dst in zip(src_blocks, dst_blocks):  # ops.swap_blocks: one cudaMemcpyAsync per block
                self.dst_tensor[dst].copy_(self.src_tensor[src], non_blocking=True)
            end_event.record(stream)
        self._transfer_events[job_id] = end_event
        self._transfers.append(Transfer(job_id, stream, start_event, end_event, len(src_blocks) * self.block_bytes))
        return True

    def get_finished(self):
        results = []
        while self._transfers and self._transfers[0].end_event.query():
            transfer = self._transfers.popleft()
            transfer_ms = transfer.start_event.elapsed_time(transfer.end_event)
            results.append((transfer.job_id, transfer.num_bytes, transfer_ms))
            self._stream_pool.append(transfer.stream)
            self._event_pool.extend((transfer.end_event, transfer.start_event))
            del self._transfer_events[transfer.job_id]
        return results

    def wait(self, job_ids):
        for job_id in job_ids:
            event = self._transfer_events.get(job_id)
            if event is not None:
                event.synchronize()


def poll_until_done(handler, job_id):
    """The worker reports finished jobs to the scheduler only through get_finished() (Event.query polling)."""
    while True:
        for done_id, nbytes, ms in handler.get_finished():
            if done_id == job_id:
                return nbytes, ms
        time.sleep(0.0005)


def paged_decode_attention(query, gpu_kv, block_ids):
    kv = gpu_kv[block_ids].view(-1, 8, 128)  # gather this request's blocks
    scores = torch.einsum("hd,thd->ht", query, kv) / 128**0.5
    return torch.einsum("ht,thd->hd", scores.softmax(-1), kv)


def main():
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    gpu_kv = torch.randn(NUM_GPU_BLOCKS, BLOCK_ELEMS, device=device)
    cpu_kv = torch.zeros(NUM_CPU_BLOCKS, BLOCK_ELEMS, pin_memory=True)
    store = SingleDirectionOffloadingHandler(gpu_kv, cpu_kv, gpu_to_cpu=True)
    load = SingleDirectionOffloadingHandler(gpu_kv, cpu_kv, gpu_to_cpu=False)
    query_a, query_b = torch.randn(8, 128, device=device), torch.randn(8, 128, device=device)
    blocks_a, blocks_b = [2, 3], [4, 5]

    # references computed up front with everything synchronous
    ref_a = paged_decode_attention(query_a, gpu_kv, blocks_a)
    ref_b = paged_decode_attention(query_b, gpu_kv, blocks_b)
    torch.cuda.synchronize(device)

    # step 0: request B finished its prefill; its KV blocks are offloaded to CPU blocks 7,9 and then freed on the GPU
    store.transfer_async(job_id=0, src_blocks=blocks_b, dst_blocks=[7, 9])
    nbytes, ms = poll_until_done(store, 0)
    print(f"store job 0: {nbytes} bytes in {ms:.3f} ms")
    free_blocks = deque(blocks_b)

    # step 1: request A's last decode step is queued; the scheduler (ahead of the GPU) frees A's blocks right away
    torch.cuda._sleep(ATTN_CYCLES)
    out_a = paged_decode_attention(query_a, gpu_kv, blocks_a)
    free_blocks.extendleft(reversed(blocks_a))

    # step 2: request B' hits B's prefix in the CPU cache: allocate GPU blocks and load them
    new_blocks_b = [free_blocks.popleft(), free_blocks.popleft()]
    load.transfer_async(job_id=1, src_blocks=[7, 9], dst_blocks=new_blocks_b)
    nbytes, ms = poll_until_done(load, 1)
    print(f"load job 1: {nbytes} bytes in {ms:.3f} ms into GPU blocks {new_blocks_b}")
    out_b = paged_decode_attention(query_b, gpu_kv, new_blocks_b)

    torch.cuda.synchronize(device)
    ok_a = torch.allclose(out_a, ref_a, atol=1e-5)
    ok_b = torch.allclose(out_b, ref_b, atol=1e-5)
    print(f"request A ok: {ok_a}, request B' ok: {ok_b}")
    print(f"match={ok_a and ok_b}")


if __name__ == "__main__":
    main()
