# graph_fork_early (FIXED version)
# Source: fork/join inside a CUDA graph capture as in meta-pytorch/torchcomms
# PR #3834 (record an event on the capturing stream, side stream waits on it, work
# on the side stream, rejoin before capture ends) and the torch.cuda.graph docs
# (static buffers, replay on the current stream). Placing the fork point before
# the producer is a plausible refactoring bug, not a specific reported issue.
# Semantics: inside a capture, side.wait_stream(capture_stream) becomes a graph
# edge from the nodes captured so far on the capture stream. Work captured on the
# capture stream AFTER the fork has no edge to the side branch: an in-graph race
# on every replay, although the capture itself succeeds (the branch is joined).
import torch

torch.manual_seed(0)
DEV = torch.device("cuda:0")
D, STEPS = 1 << 20, 5


class GatedBlock:
    """Elementwise gated block; the gate*h branch overlaps on a side stream."""

    def __init__(self):
        self.side = torch.cuda.Stream()
        self.scale = torch.rand(D, device=DEV) + 0.5
        self.bias = torch.randn(D, device=DEV) * 0.1
        # static workspaces (CUDA-graph style: no allocation inside the capture)
        self.h = torch.empty(D, device=DEV)
        self.gate = torch.empty(D, device=DEV)
        self.aux = torch.empty(D, device=DEV)
        self.out = torch.empty(D, device=DEV)

    def forward(self, x, fork=True):
        cur = torch.cuda.current_stream()
        torch.mul(x, self.scale, out=self.h)
        self.h.tanh_()
        torch.add(self.h, self.bias, out=self.gate)
        self.gate.sigmoid_()                          # producer of gate (cur)
        if fork:
            # FIX: fork point taken after the gate is produced on `cur`
            self.side.wait_stream(cur)
            with torch.cuda.stream(self.side):
                torch.mul(self.gate, self.h, out=self.aux)   # consumer (side)
        else:
            torch.mul(self.gate, self.h, out=self.aux)
        torch.mul(self.h, 0.5, out=self.out)          # main branch overlaps
        if fork:
            cur.wait_stream(self.side)                # join before capture ends
        self.out.add_(self.aux)
        return self.out


def main():
    block = GatedBlock()
    static_x = torch.randn(D, device=DEV)
    block.forward(static_x, fork=False)               # eager warm-up, one stream
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = block.forward(static_x)
    host_buf = torch.empty(D)                          # pageable staging buffer
    checksum = torch.zeros((), device=DEV)
    for step in range(STEPS):
        torch.randn(D, out=host_buf)
        # pageable source: the copy is staged before returning, so the host may
        # refill host_buf right away; it runs on the replay (current) stream
        static_x.copy_(host_buf, non_blocking=True)
        host_buf.zero_()
        g.replay()
        checksum += static_out.sum()
    torch.cuda.synchronize()
    print("checksum", checksum.item())


if __name__ == "__main__":
    main()
