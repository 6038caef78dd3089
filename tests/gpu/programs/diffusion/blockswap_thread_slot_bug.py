# Source: kohya-ss/sd-scripts library/custom_offloading_utils.py (Offloader / ModelOffloader and
#   swap_weight_devices): a ThreadPoolExecutor(max_workers=1) worker moves the weights of a block that was
#   just used back to the CPU and copies the next block's weights *into the same GPU buffer*
#   (cuda_data_view.copy_(..., non_blocking=True)) on its own torch.cuda.Stream. The real code guards this
#   with `torch.cuda.current_stream().synchronize()  # this prevents the illegal loss value`, issued from
#   the worker thread before the swap.
#
# Block swapping for a DiT-style stack: N_SLOTS GPU buffers hold the resident blocks; after block i has been
# queued on the default stream the main thread submits "swap block i out, block i+N_SLOTS in" to the worker,
# which overwrites block i's GPU buffer in place on the swap stream. wait_for_block() joins the future
# (the worker host-synchronizes its stream) before the swapped-in block is used.
#   blockswap_thread_slot_bug.py:   the worker copies into the buffer without waiting for the compute stream.
#   blockswap_thread_slot_fixed.py: the worker first synchronizes the compute (default) stream, as kohya does.
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms spin on the compute stream
DIM = 1024
N_BLOCKS = 6
N_SLOTS = 2
DEVICE = torch.device("cuda:0")


class SwapBlock(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        torch.cuda._sleep(SLEEP_CYCLES)  # slow block kernel queued ahead of the weight read
        return torch.tanh(x @ self.weight.t())


class ModelOffloader:
    def __init__(self, blocks, num_slots):
        self.blocks = blocks
        self.num_slots = num_slots
        self.cpu_weights = [b.weight.data.pin_memory() for b in blocks]
        self.swap_stream = torch.cuda.Stream()
        self.thread_pool = ThreadPoolExecutor(max_workers=1)
        self.futures = {}

    def prepare_block_devices_before_forward(self):
        for i, b in enumerate(self.blocks):
            if i < self.num_slots:
                b.weight.data = self.cpu_weights[i].to(DEVICE)  # resident blocks own the GPU buffers
            else:
                b.weight.data = self.cpu_weights[i]
        torch.cuda.synchronize()

    def _swap_weight_devices(self, idx_to_cpu, idx_to_cuda):
        # Runs on the worker thread.
        block_to_cpu = self.blocks[idx_to_cpu]
        block_to_cuda = self.blocks[idx_to_cuda]
        cuda_buffer = block_to_cpu.weight.data
        with torch.cuda.stream(self.swap_stream):
            cuda_buffer.copy_(self.cpu_weights[idx_to_cuda], non_blocking=True)
        block_to_cpu.weight.data = self.cpu_weights[idx_to_cpu]
        block_to_cuda.weight.data = cuda_buffer
        self.swap_stream.synchronize()
        return idx_to_cpu, idx_to_cuda

    def submit_move_blocks(self, block_idx):
        idx_to_cuda = block_idx + self.num_slots
        if idx_to_cuda >= len(self.blocks):
            return
        self.futures[idx_to_cuda] = self.thread_pool.submit(self._swap_weight_devices, block_idx, idx_to_cuda)

    def wait_for_block(self, block_idx):
        future = self.futures.pop(block_idx, None)
        if future is not None:
            _, idx_to_cuda = future.result()
            assert idx_to_cuda == block_idx


def main():
    torch.manual_seed(0)
    weights = [torch.randn(DIM, DIM) / DIM ** 0.5 for _ in range(N_BLOCKS)]
    blocks = nn.ModuleList([SwapBlock(w.clone()) for w in weights])
    x = torch.randn(64, DIM, device=DEVICE)

    with torch.no_grad():
        ref = x
        for w in weights:
            ref = torch.tanh(ref @ w.to(DEVICE).t())
        torch.cuda.synchronize()

        offloader = ModelOffloader(blocks, N_SLOTS)
        offloader.prepare_block_devices_before_forward()
        h = x
        for i, block in enumerate(blocks):
            offloader.wait_for_block(i)
            h = block(h)
            offloader.submit_move_blocks(i)
        offloader.thread_pool.shutdown(wait=True)

    torch.cuda.synchronize()
    checksum = h.double().sum().item()
    reference = ref.double().sum().item()
    match = torch.allclose(h, ref, rtol=1e-4, atol=1e-4)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
