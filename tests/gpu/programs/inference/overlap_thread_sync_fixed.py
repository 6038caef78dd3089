# Source: sgl-project/sglang python/sglang/srt/managers/tp_worker_overlap_thread.py
#   (TpModelWorkerClient: the scheduler thread prepares a batch on its own stream, records
#   sync_event = Event(); sync_event.record(self.scheduler_stream) and pushes
#   (model_worker_batch, future_token_ids_ct, sync_event) to input_queue; forward_thread_func_
#   runs under torch.cuda.stream(self.forward_stream) and calls sync_event.wait() before
#   resolve_future_token_ids(); results come back through copy_done.synchronize()).
# Race (bug): the forward thread's forward_stream reads of batch.input_ids (torch.where in
#   resolve_future_token_ids) vs the scheduler stream's non_blocking H2D copy that writes them.
import queue
import threading

import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms of earlier work queued on the scheduler stream
BATCH = 128
VOCAB = 1000
HIDDEN = 64
NUM_BATCHES = 5
FUTURE_MAP_SIZE = BATCH * (NUM_BATCHES + 2)


class ModelWorkerBatch:
    def __init__(self, input_ids):
        self.input_ids = input_ids


def next_tokens_from(ids, embed):
    hidden = embed[ids]  # [BATCH, HIDDEN], small integers -> exact float sums
    return (hidden.sum(dim=-1).long() * 31 + 7).remainder(VOCAB)


class TpModelWorkerClient:
    def __init__(self, device, embed):
        self.device = device
        self.embed = embed
        self.future_token_ids_map = torch.zeros(FUTURE_MAP_SIZE, dtype=torch.int64, device=device)
        self.future_token_ids_ct = 0
        self.scheduler_stream = torch.cuda.current_stream()
        self.forward_stream = torch.cuda.Stream()
        self.input_queue = queue.Queue()
        self.output_queue = queue.Queue()
        self.batch_lists = []  # keep every batch (and its GPU tensors) alive until the end
        self.forward_thread = threading.Thread(target=self.forward_thread_func, daemon=True)
        self.forward_thread.start()

    def forward_thread_func(self):
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self.forward_stream), torch.inference_mode():
            self.forward_thread_func_()

    def forward_thread_func_(self):
        while True:
            model_worker_batch, future_token_ids_ct, sync_event = self.input_queue.get()
            if model_worker_batch is None:
                return
            # FIX: make forward_stream wait until the scheduler stream has produced the inputs.
            sync_event.wait()
            self.batch_lists.append(model_worker_batch)
            copy_done = torch.cuda.Event()
            input_ids = model_worker_batch.input_ids
            # resolve_future_token_ids: negative ids point into the future map
            future_idx = torch.clamp(-input_ids, 0, FUTURE_MAP_SIZE - 1)
            resolved = torch.where(input_ids < 0, self.future_token_ids_map[future_idx], input_ids)
            resolved = resolved.remainder(VOCAB)
            next_token_ids = next_tokens_from(resolved, self.embed)
            self.future_token_ids_map[future_token_ids_ct + 1 : future_token_ids_ct + BATCH + 1] = next_token_ids
            next_token_ids_cpu = next_token_ids.to("cpu", non_blocking=True)
            copy_done.record()
            self.output_queue.put((copy_done, next_token_ids_cpu))

    def forward_batch_generation(self, host_input_ids):
        # Scheduler stream: earlier work (sampling-info updates etc.), then the H2D of the inputs.
        torch.cuda._sleep(SLEEP_CYCLES)
        input_ids = host_input_ids.to(self.device, non_blocking=True)
        batch = ModelWorkerBatch(input_ids)
        sync_event = torch.cuda.Event()
        sync_event.record(self.scheduler_stream)
        self.input_queue.put((batch, self.future_token_ids_ct, sync_event))
        ct = self.future_token_ids_ct
        self.future_token_ids_ct += BATCH
        # Placeholders (-(ct+1) ... -(ct+BATCH)) stand for this batch's not-yet-sampled tokens.
        return [-(ct + 1 + i) for i in range(BATCH)]

    def resolve_last_batch_result(self):
        copy_done, next_token_ids_cpu = self.output_queue.get()
        copy_done.synchronize()
        return next_token_ids_cpu.tolist()


def build_inputs(step, placeholders):
    fresh = [(step * 97 + 3 * i) % VOCAB for i in range(BATCH)]
    if placeholders is None:
        return fresh
    # half of the rows are decode rows fed by last batch's future tokens
    return [placeholders[i] if i % 2 == 0 else fresh[i] for i in range(BATCH)]


def reference_run(embed_cpu):
    outputs, prev = [], None
    for step in range(NUM_BATCHES):
        ids = build_inputs(step, None)
        if prev is not None:
            ids = [prev[i] if i % 2 == 0 else ids[i] for i in range(BATCH)]
        prev = next_tokens_from(torch.tensor(ids), embed_cpu).tolist()
        outputs.append(prev)
    return outputs


def main():
    device = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(4)
    embed_cpu = torch.randint(-3, 4, (VOCAB, HIDDEN), generator=g).float()
    client = TpModelWorkerClient(device, embed_cpu.to(device))
    host_bufs = [torch.empty(BATCH, dtype=torch.int64, pin_memory=True) for _ in range(NUM_BATCHES)]
    torch.cuda.synchronize()
    results = []
    with torch.inference_mode():
        placeholders = None
        for step in range(NUM_BATCHES):
            host_bufs[step].copy_(torch.tensor(build_inputs(step, placeholders), dtype=torch.int64))
            placeholders = client.forward_batch_generation(host_bufs[step])
            if step > 0:  # overlap: launch batch k, then process the result of batch k-1
                results.append(client.resolve_last_batch_result())
        results.append(client.resolve_last_batch_result())
        client.input_queue.put((None, None, None))
        client.forward_thread.join()
    torch.cuda.synchronize()
    reference = reference_run(embed_cpu)
    checksum = sum(t * (i + 1) for i, t in enumerate(tok for r in results for tok in r))
    ref_sum = sum(t * (i + 1) for i, t in enumerate(tok for r in reference for tok in r))
    print(f"checksum={checksum} reference={ref_sum} match={results == reference}")


if __name__ == "__main__":
    main()
