"""mempool_wrong_stream (fixed version).

Plausible pattern, no specific issue.  Communication buffers are often kept in a
torch.cuda.MemPool (PyTorch docs: MemPool + use_mem_pool with NCCL's ncclMemAlloc allocator for
registered / symmetric buffers); here a plain MemPool stands in for it.  Per MoE layer, small
routing statistics are built in the pool on the compute (default) stream and "sent" on a
communication stream.  record_stream is called after leaving the `with
torch.cuda.stream(comm)` block, so torch.cuda.current_stream() is the compute stream -- the
block's own allocation stream -- and the allocator ignores the call
(c10/cuda/CUDACachingAllocator.cpp recordStream: "ignore uses on the allocation stream").
The three small tensors of one send() are carved out of the same 2 MiB pool segment; only
`route` is used on the other stream.

Fix: record the comm stream explicitly: route.record_stream(self.comm).
"""
import torch

DEV = torch.device("cuda", 0)
T, D, E, LAYERS, STEPS = 4096, 512, 64, 4, 2
CAP = 2 * T // E


class ExpertLoadSync:
    def __init__(self, pool):
        self.pool = pool
        self.comm = torch.cuda.Stream(DEV)
        self.load = torch.zeros(LAYERS, 2, E, device=DEV)    # accumulated on the comm stream
        self.ones = torch.ones(T, device=DEV)

    def send(self, layer, expert_ids):
        with torch.cuda.use_mem_pool(self.pool):
            counts = torch.zeros(E, device=DEV)              # 512 B block
            counts.scatter_add_(0, expert_ids, self.ones)
            kept = counts.clamp(max=CAP)                      # 512 B block, same segment
            route = torch.stack([counts, kept])               # 512 B block, same segment
        self.comm.wait_stream(torch.cuda.current_stream(DEV))
        with torch.cuda.stream(self.comm):
            self.load[layer].add_(route)                      # comm stream reads route
        route.record_stream(self.comm)                        # FIX: the stream that used it


@torch.no_grad()
def moe_forward(x, gates, experts, sync):
    for layer in range(LAYERS):
        expert_ids = torch.matmul(x, gates[layer]).argmax(dim=-1)
        sync.send(layer, expert_ids)
        x = x + torch.tanh(torch.matmul(x, experts[layer]))   # stand-in for the experts
    return x


def main():
    torch.manual_seed(0)
    pool = torch.cuda.MemPool()
    sync = ExpertLoadSync(pool)
    gates = [torch.randn(D, E, device=DEV) for _ in range(LAYERS)]
    experts = [torch.randn(D, D, device=DEV).div_(D ** 0.5) for _ in range(LAYERS)]
    xs = [torch.randn(T, D, device=DEV) for _ in range(STEPS)]
    results = []
    for x in xs:
        out = moe_forward(x, gates, experts, sync)
        torch.cuda.current_stream(DEV).wait_stream(sync.comm)
        imbalance = sync.load[:, 0].std(dim=-1).sum()
        results.append(out.float().norm() + imbalance)
    torch.cuda.synchronize()
    print("result", round(torch.stack(results).sum().item(), 3))


if __name__ == "__main__":
    main()
