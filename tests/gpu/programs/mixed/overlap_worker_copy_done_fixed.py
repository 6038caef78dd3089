# Source: sgl-project/sglang python/sglang/srt/managers/tp_worker_overlap_thread.py, TpModelWorkerClient
#         (forward_thread_func_ runs on its own forward_stream in a worker thread; resolve_last_batch_result()).
# Bug: the forward thread samples next_token_ids on forward_stream, starts a non_blocking D2H copy into a
#      pinned CPU tensor (next_token_ids.to("cpu", non_blocking=True)) and records copy_done. The scheduler
#      (main) thread's resolve_last_batch_result() takes the pinned tensor off the output queue and calls
#      .tolist() on it without copy_done.synchronize(): the host reads pinned memory that the copy on
#      forward_stream may not have written yet.
# Fix: resolve_last_batch_result() calls copy_done.synchronize() before next_token_ids.tolist(), as SGLang does.
import threading
from collections import deque
from queue import Queue

import torch
import torch.nn as nn

SLEEP_CYCLES = 30_000_000  # ~15 ms: a large decode batch keeps forward_stream busy


class TinyLM(nn.Module):
    def __init__(self, vocab=1000, hidden=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        return self.lm_head(h + self.mlp(h))


class ModelWorkerBatch:
    def __init__(self, bid, input_ids):
        self.bid = bid
        self.input_ids = input_ids


class TpModelWorkerClient:
    """Overlaps the scheduler (main thread) with the forward pass (forward thread + forward_stream)."""

    def __init__(self, model):
        self.model = model
        self.input_queue = Queue()
        self.output_queue = Queue()
        self.forward_stream = torch.cuda.Stream()
        self.scheduler_stream = torch.cuda.current_stream()
        self.forward_thread = threading.Thread(target=self.forward_thread_func, daemon=True)
        self.forward_thread.start()

    def forward_thread_func(self):
        with torch.cuda.stream(self.forward_stream):
            self.forward_thread_func_()

    @torch.no_grad()
    def forward_thread_func_(self):
        while True:
            model_worker_batch, sync_event = self.input_queue.get()
            if model_worker_batch is None:
                break
            sync_event.wait()  # forward_stream waits for the scheduler stream that built the batch
            input_ids = model_worker_batch.input_ids
            input_ids.record_stream(self.forward_stream)
            copy_done = torch.cuda.Event()
            torch.cuda._sleep(SLEEP_CYCLES)
            logits = self.model(input_ids)
            next_token_ids = logits.argmax(dim=-1)
            next_token_ids = next_token_ids.to("cpu", non_blocking=True)
            copy_done.record()
            self.output_queue.put((copy_done, model_worker_batch.bid, next_token_ids))

    def forward_batch_generation(self, model_worker_batch):
        sync_event = torch.cuda.Event()
        sync_event.record(self.scheduler_stream)
        self.input_queue.put((model_worker_batch, sync_event))

    def resolve_last_batch_result(self):
        copy_done, bid, next_token_ids = self.output_queue.get()
        copy_done.synchronize()
        return bid, next_token_ids.tolist()

    def shutdown(self):
        self.input_queue.put((None, None))
        self.forward_thread.join()


def main():
    torch.manual_seed(0)
    model = TinyLM().cuda().eval()
    prompts = [torch.randint(0, 1000, (256,)) for _ in range(6)]
    torch.cuda.synchronize()

    worker = TpModelWorkerClient(model)
    results, inflight = {}, deque()
    for bid, ids in enumerate(prompts):  # event_loop_overlap: launch batch N, then resolve batch N-1
        batch = ModelWorkerBatch(bid, ids.to("cuda"))
        worker.forward_batch_generation(batch)
        inflight.append(batch)
        if len(inflight) > 1:
            inflight.popleft()
            rbid, toks = worker.resolve_last_batch_result()
            results[rbid] = toks
    while inflight:
        inflight.popleft()
        rbid, toks = worker.resolve_last_batch_result()
        results[rbid] = toks
    worker.shutdown()
    torch.cuda.synchronize()

    with torch.no_grad():
        ref = {bid: model(ids.cuda()).argmax(-1).cpu().tolist() for bid, ids in enumerate(prompts)}
    print(f"batches={len(results)} match={results == ref}")


if __name__ == "__main__":
    main()
