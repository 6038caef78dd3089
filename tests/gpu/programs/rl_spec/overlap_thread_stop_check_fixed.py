# Source: sgl-project/sglang python/sglang/srt/managers/tp_worker_overlap_thread.py,
#   TpModelWorkerClient.forward_thread_func_() / resolve_batch_result() (overlap scheduler: a
#   forward thread running on its own forward_stream, results handed back through output_queue
#   with a copy_done event), consumed by the scheduler's stop-criteria check (Req.check_finished:
#   EOS / max_new_tokens) in scheduler_output_processor_mixin.
# Bug: the forward thread enqueues next_token_ids.to("cpu", non_blocking=True) (a pinned tensor)
#   on forward_stream and records copy_done, but resolve_batch_result() only waits on launch_done
#   (a threading.Event meaning "kernels launched") and never calls copy_done.synchronize(). The
#   scheduler thread runs .tolist() on the pinned tensor while the D2H copy is still queued behind
#   the forward (host-device race on the pinned next_token_ids): wrong tokens, wrong EOS/finish.
# Fix: copy_done.synchronize() in resolve_batch_result() before reading the CPU tensors.
import threading
from queue import Queue

import torch

DEVICE = torch.device("cuda:0")
BATCH = 16
HIDDEN = 128
VOCAB = 512
EOS_TOKEN_ID = 7
NUM_STEPS = 8


class TpModelWorker:
    def __init__(self):
        g = torch.Generator(device=DEVICE).manual_seed(0)
        self.embed_tokens = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g)
        self.lm_head = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g)

    def forward_batch_generation(self, input_ids, launch_done):
        torch.cuda._sleep(25_000_000)  # stand-in for the decoder layers
        logits = self.embed_tokens[input_ids] @ self.lm_head.T
        next_token_ids = logits.argmax(-1)
        launch_done.set()
        return next_token_ids


class TpModelWorkerClient:
    def __init__(self, worker):
        self.worker = worker
        self.input_queue = Queue()
        self.output_queue = Queue()
        self.device_history = []  # GPU results, for the final check only
        self.forward_stream = torch.cuda.Stream(device=DEVICE)
        self.forward_thread = threading.Thread(target=self.forward_thread_func, daemon=True)
        self.forward_thread.start()

    def forward_thread_func(self):
        with torch.cuda.stream(self.forward_stream):
            self.forward_thread_func_()

    @torch.no_grad()
    def forward_thread_func_(self):
        last_token_ids = None
        while True:
            item = self.input_queue.get()
            if item is None:
                break
            prompt_last_ids, launch_done = item
            copy_done = torch.cuda.Event()
            # Resolve future token ids: decode steps consume the previous step's output on device.
            if last_token_ids is None:
                input_ids = torch.tensor(prompt_last_ids, dtype=torch.int64, device=DEVICE)
            else:
                input_ids = last_token_ids
            next_token_ids = self.worker.forward_batch_generation(input_ids, launch_done)
            last_token_ids = next_token_ids
            self.device_history.append(next_token_ids)
            next_token_ids_cpu = next_token_ids.to("cpu", non_blocking=True)
            copy_done.record()
            self.output_queue.put((copy_done, launch_done, next_token_ids_cpu))

    def resolve_batch_result(self):
        copy_done, launch_done, next_token_ids = self.output_queue.get()
        copy_done.synchronize()
        launch_done.wait()
        return next_token_ids.tolist()

    def forward_batch_generation(self, prompt_last_ids):
        launch_done = threading.Event()
        self.input_queue.put((prompt_last_ids, launch_done))

    def shutdown(self):
        self.input_queue.put(None)
        self.forward_thread.join()


class Req:
    def __init__(self, rid, max_new_tokens):
        self.rid, self.max_new_tokens = rid, max_new_tokens
        self.output_ids, self.finished_reason = [], None

    def check_finished(self):
        if self.output_ids[-1] == EOS_TOKEN_ID:
            self.finished_reason = "stop"
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = "length"


def process_batch_result(reqs, next_token_ids):
    for req, tok in zip(reqs, next_token_ids):
        if req.finished_reason is None:
            req.output_ids.append(tok)
            req.check_finished()


def main():
    worker = TpModelWorker()
    torch.cuda.synchronize()  # weights are ready before the forward thread starts
    client = TpModelWorkerClient(worker)
    reqs = [Req(i, max_new_tokens=3 + i % 6) for i in range(BATCH)]
    prompt_last_ids = [(31 * i + 5) % VOCAB for i in range(BATCH)]

    launched = 0
    for step in range(NUM_STEPS):
        client.forward_batch_generation(prompt_last_ids)
        launched += 1
        if launched > 1:  # overlap: resolve batch N-1 after launching batch N
            process_batch_result(reqs, client.resolve_batch_result())
    process_batch_result(reqs, client.resolve_batch_result())
    client.shutdown()

    torch.cuda.synchronize()
    ref_reqs = [Req(i, max_new_tokens=3 + i % 6) for i in range(BATCH)]
    for t in client.device_history:
        process_batch_result(ref_reqs, t.tolist())
    match = all(r.output_ids == q.output_ids and r.finished_reason == q.finished_reason
                for r, q in zip(reqs, ref_reqs))
    print("finished:", sum(r.finished_reason is not None for r in reqs), "of", BATCH)
    print(f"match={match}")


if __name__ == "__main__":
    main()
