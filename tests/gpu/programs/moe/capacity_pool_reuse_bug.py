# Source: NVIDIA/Megatron-LM megatron/core/utils.py GlobalMemoryBuffer.get_tensor ("Global buffer to
#   avoid dynamic memory allocations. Caller should ensure that buffers of the same name are not used
#   concurrently.") and the drop-and-pad capacity path of megatron/core/transformer/moe/
#   token_dispatcher.py (moe_pad_expert_input_to_capacity: tokens laid out as [E, capacity, H]),
#   overlapped across micro-batches as in DeepEP/Megatron EP-A2A overlap.
#   The Python pool below hands out [E * C + 1, H] capacity buffers and takes them back when the
#   micro-batch's `with` block ends; the caching allocator never sees these "frees".
# Bug (capacity_pool_reuse_bug.py): the layer releases its capacity buffer to the pool as soon as the
#   expert GEMM has been *enqueued* on the expert stream, without the completion event; the next
#   micro-batch acquires the same buffer and the dispatch scatter on the default stream overwrites it
#   while the expert stream (delayed) has not read it yet.
# Fix (capacity_pool_reuse_fixed.py): release the buffer together with the expert stream's done event;
#   acquire() makes the acquiring stream wait on it.
from contextlib import contextmanager

import torch
import torch.nn.functional as F

SLEEP_CYCLES = 20_000_000  # ~10 ms on the expert stream before each grouped GEMM
H, FFN, E, T, MICRO_BATCHES = 256, 512, 4, 1024, 3
CAP = T // E * 2  # capacity factor 2.0
DEV = torch.device("cuda:0")


class CapacityBufferPool:
    def __init__(self):
        self.free = []          # list of (buffer, event-or-None)
        self.allocated = 0

    def acquire(self):
        if self.free:
            buf, last_use = self.free.pop()
            if last_use is not None:
                torch.cuda.current_stream().wait_event(last_use)
            return buf
        self.allocated += 1
        return torch.empty(E * CAP + 1, H, device=DEV)  # + 1 trash row for dropped tokens

    def release(self, buf, last_use=None):
        self.free.append((buf, last_use))


@contextmanager
def capacity_buffer(pool):
    buf = pool.acquire()
    handle = {"last_use": None}
    try:
        yield buf, handle
    finally:
        pool.release(buf, handle["last_use"])


def dispatch_into(buf, x, top_expert):
    """Drop-and-pad layout: token -> row expert * CAP + slot; overflow goes to the trash row."""
    one_hot = (top_expert[:, None] == torch.arange(E, device=DEV)).long()   # [T, E], no host sync
    slot = ((one_hot.cumsum(0) - 1) * one_hot).sum(1)                      # position within expert
    keep = slot < CAP
    flat = torch.where(keep, top_expert * CAP + slot, torch.full_like(slot, E * CAP))
    buf.zero_()
    buf.index_copy_(0, flat, x)
    return flat, keep


def experts(buf, w1, w2):
    tokens = buf[:E * CAP].view(E, CAP, H)
    return torch.bmm(F.silu(torch.bmm(tokens, w1)), w2)


def combine_from(expert_out, flat, keep, probs):
    rows = torch.cat([expert_out.reshape(E * CAP, H), expert_out.new_zeros(1, H)])
    return rows.index_select(0, flat) * (probs * keep)[:, None]


@torch.no_grad()
def main():
    torch.manual_seed(0)
    router = torch.randn(H, E, device=DEV)
    w1 = torch.randn(E, H, FFN, device=DEV) * H ** -0.5
    w2 = torch.randn(E, FFN, H, device=DEV) * FFN ** -0.5
    xs = [torch.randn(T, H, device=DEV) for _ in range(MICRO_BATCHES)]
    torch.cuda.synchronize()

    def route(x):
        probs, top_expert = torch.softmax(x @ router, dim=-1).max(dim=-1)
        return probs, top_expert

    refs = []
    for x in xs:
        probs, top_expert = route(x)
        ref_buf = torch.empty(E * CAP + 1, H, device=DEV)
        flat, keep = dispatch_into(ref_buf, x, top_expert)
        ref_out = experts(ref_buf, w1, w2)
        refs.append(combine_from(ref_out, flat, keep, probs))
    torch.cuda.synchronize()

    pool = CapacityBufferPool()
    expert_stream = torch.cuda.Stream()
    pending = []
    for x in xs:  # micro-batch overlap: dispatch of mb i+1 overlaps the experts of mb i
        probs, top_expert = route(x)
        with capacity_buffer(pool) as (buf, handle):
            flat, keep = dispatch_into(buf, x, top_expert)      # default stream writes buf
            expert_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(expert_stream):
                torch.cuda._sleep(SLEEP_CYCLES)
                expert_out = experts(buf, w1, w2)           # expert stream reads buf
            done = expert_stream.record_event()
        pending.append((expert_out, done, flat, keep, probs))

    outs = []
    for expert_out, done, flat, keep, probs in pending:
        torch.cuda.current_stream().wait_event(done)
        outs.append(combine_from(expert_out, flat, keep, probs))
    torch.cuda.synchronize()

    out, ref = torch.stack(outs), torch.stack(refs)
    checksum = out.double().abs().sum().item()
    reference = ref.double().abs().sum().item()
    match = torch.allclose(out, ref, rtol=1e-3, atol=1e-3)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match} buffers={pool.allocated}")


if __name__ == "__main__":
    main()
