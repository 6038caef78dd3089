# Source: SGLang overlap scheduler. python/sglang/srt/managers/scheduler.py,
# Scheduler.run_batch() calls record_batch_in_overlap(model_worker_batch):
#   "FIXME(lsyin): hacky way to keep a reference to avoid GPU tensors being
#    freed by torch GC" (self.batch_record_buf = [None] * 2);
# earlier, tp_worker_overlap_thread.py forward_thread_func_() kept
# batch_lists[batch_pt % 2] = model_worker_batch: "Otherwise, the tensor
# members of model_worker_batch will be released by pytorch and cause CUDA
# illegal memory access errors." Future token ids are resolved with
# input_ids[:] = torch.where(input_ids < 0, future_map[torch.clamp(-input_ids,
# min=0)], input_ids) on the forward stream.
#
# Race (alloc-reuse): the scheduler builds each ModelWorkerBatch's input_ids /
# positions on the default (schedule) stream and launches the forward on
# self.forward_stream. Without the keep-alive buffer, run_batch() returns and
# the batch is garbage-collected while its forward is still queued; the blocks
# go back to the default stream's pool, the next batch's H2D copies on the
# default stream land in the same blocks, and the pending forward
# (resolve_future / embedding) reads and writes the next batch's data.
# Fix (as in SGLang): keep references to the last two batches; the scheduler
# waits for batch k's copy_done before it builds batch k+2, so a batch's tensors
# now outlive its GPU work.
import torch
import torch.nn as nn

DEV = "cuda:0"
V, H, B, STEPS, PROMPT_LEN = 4096, 1024, 256, 16, 64
SLEEP_CYCLES = 2_000_000  # ~1 ms GPU busy-wait: attention etc. before the embedding


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.pos_embed = nn.Embedding(PROMPT_LEN + STEPS + 1, H)
        self.mlp = nn.Sequential(nn.Linear(H, H), nn.GELU(), nn.Linear(H, H))
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, ids, positions):
        return self.lm_head(self.mlp(self.embed(ids) + self.pos_embed(positions)))


class ModelWorkerBatch:
    def __init__(self, step, input_ids, positions):
        self.step = step
        self.input_ids = input_ids
        self.positions = positions


class FutureMap:
    def __init__(self):
        self.token_ids_buf = torch.zeros((STEPS + 2) * B + 1, dtype=torch.long, device=DEV)
        self.ct = 0

    def alloc_future_indices(self, bs):
        start = self.ct + 1
        self.ct += bs
        return start

    def resolve_future(self, input_ids):
        input_ids[:] = torch.where(
            input_ids < 0,
            self.token_ids_buf[torch.clamp(-input_ids, min=0)],
            input_ids,
        )

    def store_to_map(self, start, next_token_ids):
        self.token_ids_buf[start:start + next_token_ids.numel()] = next_token_ids


class Scheduler:
    def __init__(self):
        self.model = TinyLM().to(DEV).eval()
        self.default_stream = torch.cuda.current_stream()
        self.forward_stream = torch.cuda.Stream()
        self.future_map = FutureMap()
        self.noise = torch.randn(STEPS, B, V, device=DEV)  # sampling noise
        # FIX: keep the last two batches alive (see record_batch_in_overlap).
        self.batch_record_buf = [None] * 2
        self.batch_record_ct = 0
        self.next_input_ids = torch.randint(0, V, (B,)).tolist()  # prompt's last token
        self.seq_lens = [PROMPT_LEN] * B
        self.outputs = [[] for _ in range(B)]

    def get_model_worker_batch(self, step):
        # built on the schedule (default) stream
        input_ids = torch.tensor(self.next_input_ids, dtype=torch.long).to(DEV, non_blocking=True)
        positions = torch.tensor(self.seq_lens, dtype=torch.long).to(DEV, non_blocking=True)
        return ModelWorkerBatch(step, input_ids, positions)

    def record_batch_in_overlap(self, model_worker_batch):
        self.batch_record_ct = (self.batch_record_ct + 1) % 2
        self.batch_record_buf[self.batch_record_ct] = model_worker_batch

    @torch.inference_mode()
    def run_batch(self, step):
        model_worker_batch = self.get_model_worker_batch(step)
        self.record_batch_in_overlap(model_worker_batch)
        start = self.future_map.alloc_future_indices(B)
        with torch.cuda.stream(self.forward_stream):
            self.forward_stream.wait_stream(self.default_stream)
            torch.cuda._sleep(SLEEP_CYCLES)
            self.future_map.resolve_future(model_worker_batch.input_ids)
            logits = self.model(model_worker_batch.input_ids, model_worker_batch.positions)
            next_token_ids = (logits + self.noise[model_worker_batch.step]).argmax(dim=-1)
            self.future_map.store_to_map(start, next_token_ids)
            copy_done = torch.cuda.Event()
            next_token_ids_cpu = next_token_ids.to("cpu", non_blocking=True)
            copy_done.record()
        # overlap: the next batch's inputs are this batch's (future) outputs
        self.next_input_ids = [-(start + i) for i in range(B)]
        self.seq_lens = [s + 1 for s in self.seq_lens]
        return copy_done, next_token_ids_cpu

    def process_batch_result(self, result):
        copy_done, next_token_ids_cpu = result
        copy_done.synchronize()
        for r, tok in enumerate(next_token_ids_cpu.tolist()):
            self.outputs[r].append(tok)

    def event_loop_overlap(self):
        last_result = None
        for step in range(STEPS):
            result = self.run_batch(step)
            if last_result is not None:
                self.process_batch_result(last_result)
            last_result = result
        self.process_batch_result(last_result)


def main():
    torch.manual_seed(0)
    scheduler = Scheduler()
    # warm the pinned host-memory cache, as in a long-running server (so no
    # cudaHostAlloc happens inside the loop)
    warm = [torch.empty(B, dtype=torch.long, pin_memory=True) for _ in range(4)]
    del warm
    scheduler.event_loop_overlap()
    torch.cuda.synchronize()
    checksum = 0
    for r, toks in enumerate(scheduler.outputs):
        for j, tok in enumerate(toks):
            checksum = (checksum + (r + 1) * (j + 1) * tok) % (1 << 61)
    print(f"overlap_batch_keepalive checksum: {checksum}")


if __name__ == "__main__":
    main()
