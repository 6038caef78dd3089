# context_exit_record (FIXED version)
# Source: expert-compute / dispatch overlap with a separate high-priority
# communication stream and an explicit "ready" event, as in deepseek-ai/DeepEP's
# EventOverlap (issue #412) and the compute/comm stream split of MoE runtimes.
# Recording the event just after the `with torch.cuda.stream(...)` block is a
# plausible slip, not a specific reported issue.
# Semantics: the torch.cuda.stream() context manager restores the previous
# current stream on exit (cupy/cupy PR #7866 quotes PyTorch's behaviour), and
# Event.record() with no argument records on torch.cuda.current_stream(). Stream
# priority (priority=-1) changes scheduling only, never ordering.
import torch

torch.manual_seed(0)
DEV = torch.device("cuda:0")
EXPERTS, TOKENS, DIM, STEPS = 8, 256, 512, 6


class OverlappedExperts:
    def __init__(self):
        self.compute = torch.cuda.Stream()
        self.comm = torch.cuda.Stream(priority=-1)    # high-priority comm stream
        self.w = torch.randn(EXPERTS, DIM, DIM, device=DEV) / DIM ** 0.5
        self.out_buf = torch.empty(EXPERTS, TOKENS, DIM, device=DEV)
        self.send_buf = torch.empty(EXPERTS, TOKENS, DIM, device=DEV)

    def step(self, x):
        main = torch.cuda.current_stream()
        ready = torch.cuda.Event()
        self.compute.wait_stream(main)                # x and weights are ready
        with torch.cuda.stream(self.compute):
            torch.bmm(x, self.w, out=self.out_buf)    # expert GEMMs (compute)
            self.out_buf.relu_()
            # FIX: record while self.compute is still the current stream
            ready.record()
        self.comm.wait_event(ready)
        with torch.cuda.stream(self.comm):
            self.send_buf.copy_(self.out_buf)         # "dispatch" reads out_buf
            self.send_buf.mul_(0.5)
        main.wait_stream(self.comm)                   # join both side streams
        main.wait_stream(self.compute)
        return self.send_buf


def main():
    layer = OverlappedExperts()
    acc = torch.zeros(EXPERTS, TOKENS, DIM, device=DEV)
    for step in range(STEPS):
        x = torch.randn(EXPERTS, TOKENS, DIM, device=DEV)
        y = layer.step(x)
        acc.add_(y)                                   # main consumes send_buf
    summary = torch.empty(4, pin_memory=True)
    summary.copy_(acc.flatten()[:4], non_blocking=True)   # D2H into pinned (main)
    done = torch.cuda.Event(blocking=True)
    done.record()
    done.synchronize()                                # host waits for that copy
    print("acc head", summary.tolist())


if __name__ == "__main__":
    main()
