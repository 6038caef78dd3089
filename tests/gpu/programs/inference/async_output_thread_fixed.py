# Source: vllm-project/vllm vllm/v1/executor/multiproc_executor.py (WorkerProc.handle_output ->
#   async_output_queue -> async_output_busy_loop, the "WorkerAsyncOutputCopy" thread) together with
#   vllm/v1/worker/gpu_model_runner.py AsyncGPUModelRunnerOutput: sampled token ids are copied
#   D2H with non_blocking=True on async_output_copy_stream, async_copy_ready_event is recorded,
#   and get_output() -- run on the output thread -- must synchronize that event before .tolist().
# Race (bug): the output thread's .tolist() read of the pinned CPU tensor vs the still-queued
#   D2H copy on async_output_copy_stream that writes it.
import queue
import threading

import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms backlog on the output copy stream
BATCH = 256
HIDDEN = 512
VOCAB = 4096
STEPS = 5


class AsyncGPUModelRunnerOutput:
    def __init__(self, step, sampled_token_ids, copy_stream):
        self.step = step
        # Keep the GPU tensor alive for the whole life of this object (vLLM does the same).
        self._sampled_token_ids = sampled_token_ids
        self.async_copy_ready_event = torch.cuda.Event()
        default_stream = torch.cuda.current_stream()
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_stream(default_stream)
            torch.cuda._sleep(SLEEP_CYCLES)
            self.sampled_token_ids_cpu = self._sampled_token_ids.to("cpu", non_blocking=True)
            self.async_copy_ready_event.record()

    def get_output(self):
        # FIX: block this output thread until the D2H copy into the pinned tensor has finished.
        self.async_copy_ready_event.synchronize()
        return self.step, self.sampled_token_ids_cpu.tolist()


class Worker:
    def __init__(self, device):
        g = torch.Generator().manual_seed(1)
        self.lm_head = torch.randn(HIDDEN, VOCAB, generator=g).to(device)
        self.hidden = torch.randn(STEPS, BATCH, HIDDEN, generator=g).to(device)
        self.copy_stream = torch.cuda.Stream()
        self.async_output_queue = queue.Queue()
        self.results = {}
        self.in_flight = []  # every output object stays referenced until the end
        self.output_thread = threading.Thread(target=self.async_output_busy_loop, daemon=True)
        self.output_thread.start()

    def async_output_busy_loop(self):
        torch.cuda.set_device(0)
        with torch.inference_mode():
            while True:
                output = self.async_output_queue.get()
                if output is None:
                    return
                step, token_ids = output.get_output()
                self.results[step] = token_ids

    def execute_model(self, step):
        logits = self.hidden[step] @ self.lm_head
        sampled = logits.argmax(dim=-1)
        output = AsyncGPUModelRunnerOutput(step, sampled, self.copy_stream)
        self.in_flight.append(output)
        self.async_output_queue.put(output)  # handle_output() with async scheduling


def main():
    device = torch.device("cuda", 0)
    worker = Worker(device)
    torch.cuda.synchronize()
    with torch.inference_mode():
        for step in range(STEPS):
            worker.execute_model(step)
        worker.async_output_queue.put(None)
        worker.output_thread.join()
    torch.cuda.synchronize()
    seen = [tok for s in range(STEPS) for tok in worker.results[s]]
    truth = [tok for out in worker.in_flight for tok in out.sampled_token_ids_cpu.tolist()]
    checksum = sum((i + 1) * t for i, t in enumerate(seen))
    reference = sum((i + 1) * t for i, t in enumerate(truth))
    print(f"checksum={checksum} reference={reference} match={seen == truth}")


if __name__ == "__main__":
    main()
