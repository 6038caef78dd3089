# Source: sgl-project/sglang python/sglang/srt/managers/tp_worker_overlap_thread.py, TpModelWorkerClient:
#   a forward thread runs under `with torch.cuda.stream(self.forward_stream)`, copies next_token_ids with
#   .to("cpu", non_blocking=True), records `copy_done = torch.cuda.Event()` and puts it on output_queue;
#   the scheduler thread's resolve_batch_result() calls copy_done.synchronize() before .tolist().
#   Bug: resolve_batch_result() only waits on launch_done (a threading.Event meaning "kernels launched"),
#   which is a host-side signal and says nothing about the D2H copy having run.
import queue
import threading

import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms: a slow forward pass on the forward stream
DEVICE = torch.device("cuda", 0)
VOCAB = 8192
HIDDEN = 512
BATCH = 128
NUM_BATCHES = 6


class TpModelWorkerClient:
    def __init__(self, model):
        self.model = model
        self.input_queue = queue.Queue()
        self.output_queue = queue.Queue()
        self.forward_stream = torch.cuda.Stream()
        # Keep references to every batch and its device results so that nothing the forward stream
        # touches is released while it may still be in use.
        self.batch_lists = []
        self.host_results = []  # pinned host copies, also kept until shutdown
        self.forward_thread = threading.Thread(target=self.forward_thread_func, daemon=True)
        self.forward_thread.start()

    def forward_thread_func(self):
        with torch.cuda.stream(self.forward_stream):
            self.forward_thread_func_()

    @torch.no_grad()
    def forward_thread_func_(self):
        while True:
            hidden = self.input_queue.get()
            if hidden is None:
                break
            launch_done = threading.Event()
            copy_done = torch.cuda.Event()

            torch.cuda._sleep(SLEEP_CYCLES)
            logits = self.model(hidden)
            next_token_ids = logits.argmax(dim=-1)
            self.batch_lists.append((hidden, next_token_ids))
            launch_done.set()

            next_token_ids_cpu = next_token_ids.to("cpu", non_blocking=True)
            copy_done.record()
            self.output_queue.put((copy_done, launch_done, next_token_ids_cpu))

    def forward_batch_generation(self, hidden):
        self.input_queue.put(hidden)

    def resolve_batch_result(self):
        copy_done, launch_done, next_token_ids = self.output_queue.get()
        self.host_results.append(next_token_ids)
        # fix: wait for the D2H copy itself (event recorded on the forward stream after the copy)
        copy_done.synchronize()
        launch_done.wait()
        return next_token_ids.tolist()

    def shutdown(self):
        self.input_queue.put(None)
        self.forward_thread.join()


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, VOCAB)).to(DEVICE)
    batches = [torch.randn(BATCH, HIDDEN, device=DEVICE) for _ in range(NUM_BATCHES)]
    torch.cuda.synchronize()

    worker = TpModelWorkerClient(model)
    results = []
    # Overlap scheduling: launch batch i, then process the result of batch i-1.
    for i, hidden in enumerate(batches):
        worker.forward_batch_generation(hidden)
        if i > 0:
            results.append(worker.resolve_batch_result())
    results.append(worker.resolve_batch_result())
    worker.shutdown()

    torch.cuda.synchronize()
    reference = [ids.tolist() for _, ids in worker.batch_lists]
    checksum = sum(sum(r) for r in results)
    ref_sum = sum(sum(r) for r in reference)
    match = results == reference
    print(f"checksum={checksum} reference={ref_sum} match={match}")


if __name__ == "__main__":
    main()
