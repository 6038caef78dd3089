# Source: kakaobrain/torchgpipe torchgpipe/worker.py (one worker thread per partition, tasks
#   handed over through queue.Queue) and torchgpipe/copy.py (class Wait: before a partition
#   touches a micro-batch, its stream is made to wait on the stream that produced it).
# Pattern: GPipe-style forward over two partitions. Each partition is a worker thread that owns
#   a torch.cuda.Stream(); the micro-batch plus a CUDA event recorded after it was produced
#   travel through a queue (the event stands in for send/recv completion).
import queue
import threading

import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
DEV = torch.device("cuda", 0)
N_MICRO = 4
ROWS, DIM = 1024, 1024


class Partition:
    def __init__(self, weight, inbox, outbox, slow):
        self.weight = weight
        self.inbox = inbox
        self.outbox = outbox
        self.slow = slow
        self.stream = torch.cuda.Stream(device=DEV)
        self.produced = []  # keeps every output micro-batch alive until the end of the run
        self.thread = threading.Thread(target=self.run, daemon=True)

    def compute(self, x):
        if self.slow:
            torch.cuda._sleep(SLEEP_CYCLES)
        return torch.relu(x @ self.weight)

    def run(self):
        torch.cuda.set_device(DEV)
        while True:
            msg = self.inbox.get()
            if msg is None:
                self.outbox.put(None)
                return
            x, ready = msg
            ready.wait()
            with torch.cuda.stream(self.stream):
                y = self.compute(x)
                done = torch.cuda.Event()
                done.record(self.stream)
            self.produced.append(y)
            self.outbox.put((y, done))


def main():
    torch.manual_seed(0)
    w0 = torch.randn(DIM, DIM, device=DEV) / DIM ** 0.5
    w1 = torch.randn(DIM, DIM, device=DEV) / DIM ** 0.5
    inputs = [torch.randn(ROWS, DIM, device=DEV) for _ in range(N_MICRO)]
    reference = torch.stack([torch.relu(torch.relu(x @ w0) @ w1) for x in inputs])

    q01, q12, q_out = queue.Queue(), queue.Queue(), queue.Queue()
    parts = [Partition(w0, q01, q12, slow=True), Partition(w1, q12, q_out, slow=False)]
    for part in parts:
        # weights and inputs were materialized on the default stream
        part.stream.wait_stream(torch.cuda.current_stream())
        part.thread.start()

    for x in inputs:
        ready = torch.cuda.Event()
        ready.record()
        q01.put((x, ready))
    q01.put(None)

    outputs = []
    while True:
        msg = q_out.get()
        if msg is None:
            break
        y, done = msg
        done.wait()  # main thread: current stream is the default stream
        outputs.append(y)
    for part in parts:
        part.thread.join()

    torch.cuda.synchronize()
    result = torch.stack(outputs)
    checksum = result.sum().item()
    ok = torch.allclose(result, reference, rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()
    print(f"checksum={checksum:.6f} reference={reference.sum().item():.6f} match={ok}")


if __name__ == "__main__":
    main()
