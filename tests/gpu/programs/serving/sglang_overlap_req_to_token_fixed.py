# Source: SGLang PR #18746 "Fix scheduler stream race conditions with overlap
# schedule on" (python/sglang/srt/managers/scheduler.py).  In the overlap
# event loop the forward of batch i runs on forward_stream while the scheduler
# already runs prepare_for_decode() of batch i+1 on its own (schedule) stream.
# prepare_for_decode() writes req_to_token_pool.req_to_token, the same tensor
# the forward of batch i reads to build its KV indices.  FIXED as in the PR:
# an event is recorded on forward_stream after the forward is launched and the
# schedule stream waits on it before the next prepare_for_decode().
from collections import deque

import torch

DEV = torch.device("cuda:0")
MAX_REQS, MAX_CTX, HIDDEN, VOCAB, BS, NUM_STEPS = 64, 512, 512, 4096, 32, 8


class ReqToTokenPool:
    def __init__(self):
        self.req_to_token = torch.zeros(MAX_REQS, MAX_CTX, dtype=torch.int32, device=DEV)

    def write(self, indices, values):
        self.req_to_token[indices] = values


class TokenToKVPool:
    def __init__(self, size):
        self.k_buffer = torch.zeros(size, HIDDEN, device=DEV)
        self.free_slots = torch.arange(1, size, dtype=torch.int64, device=DEV)

    def alloc(self, need):  # views of the persistent free list, no new memory
        out, self.free_slots = self.free_slots[:need], self.free_slots[need:]
        return out


class ModelWorkerBatch:  # snapshot of the tensors the forward reads
    def __init__(self, b):
        self.input_ids, self.req_pool_indices = b.input_ids, b.req_pool_indices
        self.seq_lens, self.out_cache_loc = b.seq_lens, b.out_cache_loc


class ScheduleBatch:
    def __init__(self, req_pool, kv_pool, prefix_len):
        self.req_to_token_pool, self.kv_pool = req_pool, kv_pool
        self.req_pool_indices = torch.arange(BS, dtype=torch.int64, device=DEV)
        self.seq_lens = torch.full((BS,), prefix_len, dtype=torch.int64, device=DEV)
        self.input_ids = torch.zeros(BS, dtype=torch.int64, device=DEV)
        self.out_cache_loc = None

    def prepare_for_decode(self):
        self.out_cache_loc = self.kv_pool.alloc(BS)
        self.req_to_token_pool.write((self.req_pool_indices, self.seq_lens), self.out_cache_loc.to(torch.int32))
        # Do not use in-place operations in the overlap mode
        self.seq_lens = self.seq_lens + 1


class ModelRunner:
    def __init__(self, req_pool, kv_pool):
        g = torch.Generator(device=DEV).manual_seed(0)
        self.embed = torch.randn(VOCAB, HIDDEN, device=DEV, generator=g) * 0.05
        self.lm_head = torch.randn(HIDDEN, VOCAB, device=DEV, generator=g) * 0.05
        self.req_pool, self.kv_pool = req_pool, kv_pool
        self.pos = torch.arange(MAX_CTX, device=DEV)

    def forward(self, mwb):
        # Attention backend metadata: KV indices for every request (full rows).
        kv_idx = self.req_pool.req_to_token[mwb.req_pool_indices].to(torch.int64)
        valid = self.pos.unsqueeze(0) < mwb.seq_lens.unsqueeze(1)
        q = self.embed[mwb.input_ids]
        self.kv_pool.k_buffer[mwb.out_cache_loc] = q
        k = self.kv_pool.k_buffer[kv_idx]                           # [BS, CTX, H]
        scores = torch.einsum("bh,bch->bc", q, k).masked_fill(~valid, -1e4)
        ctx = torch.einsum("bc,bch->bh", scores.softmax(-1), k)
        return (ctx + q) @ self.lm_head


class Scheduler:
    def __init__(self):
        self.req_pool, self.kv_pool = ReqToTokenPool(), TokenToKVPool(BS * MAX_CTX)
        self.model_runner = ModelRunner(self.req_pool, self.kv_pool)
        self.schedule_stream = torch.cuda.Stream(priority=-1)
        self.forward_stream = torch.cuda.Stream()
        self.result_queue, self.outputs = deque(), []
        self._last_forward_done = torch.cuda.Event()

    def get_new_batch_prefill(self, prefix_len=16):  # prefill itself elided
        batch = ScheduleBatch(self.req_pool, self.kv_pool, prefix_len)
        prefix = self.kv_pool.alloc(BS * prefix_len).view(BS, prefix_len)
        self.req_pool.req_to_token[:BS, :prefix_len] = prefix.to(torch.int32)
        return batch

    def run_batch(self, batch):
        mwb = ModelWorkerBatch(batch)
        self.forward_stream.wait_stream(self.schedule_stream)
        with torch.cuda.stream(self.forward_stream):
            next_ids = self.model_runner.forward(mwb).argmax(dim=-1)
            self._last_forward_done.record()  # FIX: recorded on forward_stream
            batch.input_ids = next_ids  # future token ids for the next decode
            next_ids_cpu = next_ids.to("cpu", non_blocking=True)
            copy_done = torch.cuda.Event()
            copy_done.record()
        return mwb, next_ids_cpu, copy_done

    def process_batch_result(self, result):
        mwb, next_ids_cpu, copy_done = result
        copy_done.synchronize()
        self.outputs.append(next_ids_cpu.tolist())  # mwb dropped after the sync

    def event_loop_overlap(self):
        with torch.cuda.stream(self.schedule_stream):
            self.batch = self.get_new_batch_prefill()
            for _ in range(NUM_STEPS):
                self.schedule_stream.wait_event(self._last_forward_done)  # FIX
                self.batch.prepare_for_decode()
                self.result_queue.append(self.run_batch(self.batch))
                if len(self.result_queue) > 1:
                    self.process_batch_result(self.result_queue.popleft())
            while self.result_queue:
                self.process_batch_result(self.result_queue.popleft())


def main():
    sched = Scheduler()
    torch.cuda.synchronize()
    sched.event_loop_overlap()
    torch.cuda.synchronize()
    print("decoded steps:", len(sched.outputs), "first:", sched.outputs[0][:4])


if __name__ == "__main__":
    main()
