# Source: ModelTC/LightX2V lightx2v/common/offload/manager.py
#   WeightAsyncStreamManager: block weights are streamed from CPU into two
#   device buffers (cuda_buffers[0] used by compute_stream, cuda_buffers[1]
#   filled by cuda_load_stream in prefetch_weights()); swap_blocks() calls
#   cuda_load_stream.synchronize() AND compute_stream.synchronize() before
#   swapping the two buffers.
# Pattern here: the active weight is an nn.Parameter whose storage is swapped
# with the staging buffer by Tensor.set_(), so the module keeps one Parameter
# object while its memory alternates between two device buffers.  Both the
# compute stream and the load stream are side streams (torch.cuda.Stream()).
import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
DIM = 1024
BLOCKS = 6
BATCH = 512


class StreamedBlock(nn.Module):
    def __init__(self, dev):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(DIM, DIM, device=dev), requires_grad=False)

    def forward(self, x):
        return torch.tanh(x @ self.weight)


class WeightStreamManager:
    def __init__(self, block, dev):
        self.compute_stream = torch.cuda.Stream()
        self.load_stream = torch.cuda.Stream()
        self.active = block.weight                          # buffer read by compute_stream
        self.staging = torch.empty(DIM, DIM, device=dev)     # buffer written by load_stream

    def init_first_buffer(self, cpu_weight):
        with torch.cuda.stream(self.load_stream):
            self.active.copy_(cpu_weight, non_blocking=True)
        self.load_stream.synchronize()

    def prefetch_weights(self, cpu_weight):
        with torch.cuda.stream(self.load_stream):
            self.staging.copy_(cpu_weight, non_blocking=True)

    def swap_blocks(self):
        self.load_stream.synchronize()
        # FIX: the retired buffer is rewritten by the next prefetch; wait for its readers
        self.compute_stream.synchronize()
        with torch.no_grad():
            old = torch.empty(0, device=self.active.device)
            old.set_(self.active)              # old   -> storage the compute stream used
            self.active.set_(self.staging)     # param -> freshly loaded storage
            self.staging.set_(old)             # next prefetch target = retired storage


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    cpu_weights = [(torch.randn(DIM, DIM) / DIM ** 0.5).pin_memory() for _ in range(BLOCKS)]
    x0 = torch.randn(BATCH, DIM, device=dev)

    # reference: all block weights resident, default stream only
    ref = x0
    for w in cpu_weights:
        ref = torch.tanh(ref @ w.to(dev))
    reference = ref.double().sum().item()
    torch.cuda.synchronize()

    block = StreamedBlock(dev)
    mgr = WeightStreamManager(block, dev)
    mgr.init_first_buffer(cpu_weights[0])

    mgr.compute_stream.wait_stream(torch.cuda.current_stream())   # x0 was made on default
    x = x0
    with torch.no_grad():
        for i in range(BLOCKS):
            with torch.cuda.stream(mgr.compute_stream):
                torch.cuda._sleep(SLEEP_CYCLES)       # attention etc. before the weight read
                x = block(x)
            if i + 1 < BLOCKS:
                mgr.prefetch_weights(cpu_weights[i + 1])
                mgr.swap_blocks()
    torch.cuda.current_stream().wait_stream(mgr.compute_stream)
    checksum = x.double().sum().item()
    torch.cuda.synchronize()
    match = abs(checksum - reference) <= 1e-3 * max(1.0, abs(reference))
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
