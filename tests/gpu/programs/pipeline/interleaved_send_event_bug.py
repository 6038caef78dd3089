# Source: NVIDIA/Megatron-LM megatron/core/pipeline_parallel/schedules.py
#   (forward_backward_pipelining_with_interleaving: virtual pipeline chunks, model chunk id
#   = (k // pp) % num_chunks) and megatron/core/pipeline_parallel/p2p_communication.py
#   (send/recv of activations between neighbouring pipeline ranks).
# Pattern: single-process stand-in for an interleaved (virtual-stage) forward schedule. Two
#   "ranks" are two side streams, each holding two model chunks (virtual stages 0..3, stage v on
#   rank v % 2). A P2PLink stages the activation into a sender-owned send buffer and hands the
#   receiver an event that marks the send as complete; the receiver's stream waits on it.
import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time, stands in for wire latency of the link
DEV = torch.device("cuda", 0)
PP = 2            # physical pipeline ranks (streams)
CHUNKS = 2        # model chunks per rank
N_MICRO = 4
ROWS, DIM = 512, 1024


class P2PLink:
    def __init__(self, src_stream, dst_stream):
        self.src = src_stream
        self.dst = dst_stream
        self.in_flight = []  # send buffers stay alive until the end of the run

    def send(self, y):
        with torch.cuda.stream(self.src):
            buf = torch.empty_like(y)
            ready = self.src.record_event()
            torch.cuda._sleep(SLEEP_CYCLES)
            buf.copy_(y)
        self.in_flight.append(buf)
        return buf, ready

    def recv(self, msg):
        buf, ready = msg
        self.dst.wait_event(ready)
        return buf


def interleaved_order(n_micro):
    """Host issue order (micro-batch, model chunk) of Megatron's interleaved schedule."""
    for k in range(n_micro * CHUNKS):
        chunk = (k // PP) % CHUNKS
        mb = (k // (PP * CHUNKS)) * PP + k % PP
        yield mb, chunk


def main():
    torch.manual_seed(0)
    n_stages = PP * CHUNKS
    weights = [torch.randn(DIM, DIM, device=DEV) / DIM ** 0.5 for _ in range(n_stages)]
    inputs = [torch.randn(ROWS, DIM, device=DEV) for _ in range(N_MICRO)]

    reference = []
    for x in inputs:
        for w in weights:
            x = torch.tanh(x @ w)
        reference.append(x)
    reference = torch.stack(reference)

    streams = [torch.cuda.Stream(device=DEV) for _ in range(PP)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())  # weights / inputs come from the default stream
    links = {r: P2PLink(streams[r], streams[(r + 1) % PP]) for r in range(PP)}

    def run_stage(v, x):
        with torch.cuda.stream(streams[v % PP]):
            return torch.tanh(x @ weights[v])

    pending = {}   # (mb, next virtual stage) -> message in flight
    outputs = {}
    for mb, chunk in interleaved_order(N_MICRO):
        for rank in range(PP):
            v = chunk * PP + rank
            x = inputs[mb] if v == 0 else links[(v - 1) % PP].recv(pending.pop((mb, v)))
            y = run_stage(v, x)
            if v == n_stages - 1:
                outputs[mb] = y
            else:
                pending[(mb, v + 1)] = links[v % PP].send(y)

    torch.cuda.current_stream().wait_stream(streams[(n_stages - 1) % PP])
    torch.cuda.synchronize()
    result = torch.stack([outputs[mb] for mb in range(N_MICRO)])
    checksum = result.sum().item()
    ok = torch.allclose(result, reference, rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()
    print(f"checksum={checksum:.6f} reference={reference.sum().item():.6f} match={ok}")


if __name__ == "__main__":
    main()
