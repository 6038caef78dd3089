# Source: sglang python/sglang/srt/managers/tp_worker_overlap_thread.py, TpModelWorkerClient
#         (forward_batch_generation() on the scheduler thread records sync_event on self.scheduler_stream and
#         puts (model_worker_batch, future_token_ids_ct, sync_event) on input_queue; forward_thread_func_() runs
#         under `with torch.cuda.stream(self.forward_stream)` and must call
#         self.forward_stream.wait_event(sync_event) before CudaGraphRunner.replay() copies the batch into the
#         graph's static input_ids buffer). Older versions used torch.cuda.current_stream().synchronize()
#         "to avoid the cuda illegal memory access error" for the same reason.
# Bug: the forward thread never waits on sync_event. The scheduler thread builds batch.input_ids on the
#      scheduler (default) stream (a non_blocking H2D copy queued behind other scheduler-stream work), and the
#      forward thread's CudaGraphRunner.replay() reads it on forward_stream with
#      self.input_ids[:bs].copy_(batch.input_ids): default-stream write vs forward_stream read of the
#      batch.input_ids device tensor with no event between them, so the graph decodes stale token ids.
# Fix: self.forward_stream.wait_event(sync_event) in the forward thread before replaying the graph.
import threading
from dataclasses import dataclass
from queue import Queue

import torch

DEVICE = torch.device("cuda:0")
SLEEP_CYCLES = 30_000_000  # ~15 ms on an H200
VOCAB, HIDDEN, BS, STEPS = 2048, 256, 16, 6


class VocabParallelEmbedding(torch.nn.Embedding):
    """tp_size=1 VocabParallelEmbedding: ids outside this shard's vocab range are masked to a zero row."""

    def forward(self, input_):
        input_mask = (input_ < 0) | (input_ >= self.num_embeddings)
        out = super().forward(input_.masked_fill(input_mask, 0))
        return out.masked_fill(input_mask.unsqueeze(-1), 0.0)


class TinyCausalLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN)
        self.mlp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        return self.lm_head(h + torch.relu(self.mlp(h)))


@dataclass
class ModelWorkerBatch:
    input_ids: torch.Tensor  # device tensor produced on the scheduler stream
    input_ids_cpu: torch.Tensor  # pinned source of that copy (kept alive with the batch)


class CudaGraphRunner:
    def __init__(self, model):
        self.model = model
        self.input_ids = torch.ones(BS, dtype=torch.int64, device=DEVICE)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model(self.input_ids).argmax(-1)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.next_token_ids = model(self.input_ids).argmax(-1)

    def replay(self, batch):
        self.input_ids[:BS].copy_(batch.input_ids)
        self.graph.replay()
        return self.next_token_ids


class TpModelWorkerClient:
    def __init__(self, model):
        self.graph_runner = CudaGraphRunner(model)
        torch.cuda.synchronize()
        self.scheduler_stream = torch.cuda.current_stream()
        self.forward_stream = torch.cuda.Stream()
        self.input_queue, self.output_queue = Queue(), Queue()
        self.forward_thread = threading.Thread(target=self.forward_thread_func, daemon=True)
        self.forward_thread.start()

    def forward_thread_func(self):
        with torch.cuda.stream(self.forward_stream):
            self.forward_thread_func_()

    @torch.no_grad()
    def forward_thread_func_(self):
        batch_lists = []  # keep a reference so the batch tensors outlive their use on forward_stream
        while True:
            item = self.input_queue.get()
            if item is None:
                break
            model_worker_batch, sync_event = item
            batch_lists.append(model_worker_batch)
            # FIX: order forward_stream after the scheduler stream's writes to this batch
            self.forward_stream.wait_event(sync_event)
            copy_done = torch.cuda.Event()
            next_token_ids = self.graph_runner.replay(model_worker_batch)
            next_token_ids = next_token_ids.to("cpu", non_blocking=True)
            copy_done.record()
            self.output_queue.put((copy_done, next_token_ids))

    def forward_batch_generation(self, model_worker_batch):
        sync_event = torch.cuda.Event()
        sync_event.record(self.scheduler_stream)
        self.input_queue.put((model_worker_batch, sync_event))

    def resolve_last_batch_result(self):
        copy_done, next_token_ids = self.output_queue.get()
        copy_done.synchronize()
        return next_token_ids.tolist()

    def shutdown(self):
        self.input_queue.put(None)
        self.forward_thread.join()


def prepare_for_decode(token_rows):
    """Scheduler-side batch construction (ScheduleBatch.prepare_for_decode + get_model_worker_batch)."""
    torch.cuda._sleep(SLEEP_CYCLES)  # stand-in for req_to_token / seq_lens updates on the scheduler stream
    input_ids_cpu = torch.tensor(token_rows, dtype=torch.int64).pin_memory()
    input_ids = input_ids_cpu.to(DEVICE, non_blocking=True)
    return ModelWorkerBatch(input_ids=input_ids, input_ids_cpu=input_ids_cpu)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = TinyCausalLM().to(DEVICE).eval()
    worker = TpModelWorkerClient(model)
    steps_tokens = torch.randint(1, VOCAB, (STEPS, BS)).tolist()

    results = []
    for step in range(STEPS):  # Scheduler.event_loop_overlap
        worker.forward_batch_generation(prepare_for_decode(steps_tokens[step]))
        if step > 0:
            results.append(worker.resolve_last_batch_result())
    results.append(worker.resolve_last_batch_result())
    worker.shutdown()

    torch.cuda.synchronize()
    ref = [model(torch.tensor(t, device=DEVICE)).argmax(-1).tolist() for t in steps_tokens]
    print(f"steps={len(results)} match={ref == results}")


if __name__ == "__main__":
    main()
