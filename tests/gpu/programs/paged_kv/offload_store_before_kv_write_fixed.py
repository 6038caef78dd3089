# Source: vllm-project/vllm PR #31341 "[BugFix] Wait for compute before offloading KV
# to CPU" (OffloadingConnector: the offload stream now wait_stream()s on the compute
# stream before GPU->CPU copies).  The same hazard came back in SimpleCPUOffloadConnector
# (issue #45704, PR #46278) and in SGLang HiCache write-through (sgl-project/sglang
# PR #20611, write_stream.wait_stream(forward_stream)).
# Plain-torch model of vllm/v1/kv_offload/worker/cpu_gpu.py SingleDirectionOffloadingHandler
# (one stream per transfer, chained by end events) with reshape_and_cache written as
# index_copy_ over a host-built slot mapping.
#
# FIXED version. The bug was: transfer_async() for GPU->CPU does not make the transfer stream wait for the
# compute stream, so the D2H copy of a just-filled block is unordered with the
# index_copy_ that wrote that block's last tokens.
from collections import deque

import torch

DEV = torch.device("cuda:0")
NUM_GPU_BLOCKS, NUM_CPU_BLOCKS = 32, 32
BLOCK, HEADS, DIM = 16, 8, 64


def async_h2d(values):
    t = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    return t.to(DEV, non_blocking=True)


class GpuToCpuHandler:
    def __init__(self, gpu_kv, cpu_kv):
        self.gpu_kv, self.cpu_kv = gpu_kv, cpu_kv
        self.transfers = deque()  # (job_id, stream, end_event)

    def transfer_async(self, job_id, gpu_blocks, cpu_blocks):
        stream = torch.cuda.Stream()
        end_event = torch.cuda.Event()
        # FIX (#31341): wait for model computation to finish before offloading
        stream.wait_stream(torch.cuda.current_stream())
        if self.transfers:
            # jobs run in submission order
            stream.wait_event(self.transfers[-1][2])
        with torch.cuda.stream(stream):
            for g, c in zip(gpu_blocks, cpu_blocks):
                self.cpu_kv[c].copy_(self.gpu_kv[g], non_blocking=True)
            end_event.record(stream)
        self.transfers.append((job_id, stream, end_event))

    def wait_all(self):
        done = []
        while self.transfers:
            job_id, _, ev = self.transfers.popleft()
            ev.synchronize()
            done.append(job_id)
        return done


class Request:
    def __init__(self, block_table):
        self.block_table = block_table
        self.num_tokens = 0
        self.num_stored_blocks = 0


class ModelRunner:
    def __init__(self):
        self.gpu_kv = torch.zeros(NUM_GPU_BLOCKS, BLOCK, 2, HEADS, DIM,
                                  device=DEV, dtype=torch.float16)
        self.cpu_kv = torch.zeros(NUM_CPU_BLOCKS, BLOCK, 2, HEADS, DIM,
                                  dtype=torch.float16, pin_memory=True)
        self.kv_slots = self.gpu_kv.view(-1, 2, HEADS, DIM)  # token-granular view
        self.offload = GpuToCpuHandler(self.gpu_kv, self.cpu_kv)
        self.next_job = 0

    def forward(self, req, num_new):  # compute stream
        pos = range(req.num_tokens, req.num_tokens + num_new)
        slots = [req.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in pos]
        new_kv = torch.randn(num_new, 2, HEADS, DIM, device=DEV, dtype=torch.float16)
        self.kv_slots.index_copy_(0, async_h2d(slots), new_kv)  # reshape_and_cache
        req.num_tokens += num_new
        kv = self.gpu_kv.index_select(0, async_h2d(req.block_table))
        return kv[:, :, 0].float().mean()  # stand-in for attention + sampling

    def offload_full_blocks(self, req, cpu_base):
        full = req.num_tokens // BLOCK
        if full > req.num_stored_blocks:
            gpu = req.block_table[req.num_stored_blocks:full]
            cpu = [cpu_base + i for i in range(req.num_stored_blocks, full)]
            self.offload.transfer_async(self.next_job, gpu, cpu)
            self.next_job += 1
            req.num_stored_blocks = full


def main():
    torch.manual_seed(0)
    runner = ModelRunner()
    torch.cuda.synchronize()  # setup done before any side-stream work

    reqs = [Request(list(range(0, 6))), Request(list(range(8, 14)))]
    logits = []
    for r in reqs:  # prefill: 3 full blocks + 5 tokens
        logits.append(runner.forward(r, 3 * BLOCK + 5))
    for step in range(2 * BLOCK):  # decode, offloading blocks as they fill up
        for i, r in enumerate(reqs):
            logits.append(runner.forward(r, 1))
            runner.offload_full_blocks(r, cpu_base=16 * i)
    jobs = runner.offload.wait_all()
    torch.cuda.synchronize()
    stored = sum(r.num_stored_blocks for r in reqs)
    print("jobs", len(jobs), "stored blocks", stored,
          "cpu checksum", float(runner.cpu_kv.float().abs().sum()),
          "logits", float(torch.stack(logits).sum()))


if __name__ == "__main__":
    main()
