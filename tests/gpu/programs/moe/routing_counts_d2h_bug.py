# Source: NVIDIA/Megatron-LM megatron/core/transformer/moe/token_dispatcher.py
#   MoEAlltoAllTokenDispatcher: preprocess() computes tokens_per_expert on the GPU and must not copy it;
#   _maybe_dtoh_and_synchronize(point) issues the non_blocking D2H copies on the class-level
#   cuda_dtoh_stream at self.cuda_dtoh_point, records d2h_event, and calls d2h_event.synchronize() only
#   at self.cuda_sync_point, which code paths that need host values must move earlier with
#   _maybe_update_cuda_sync_point(point) (priority table, default "no_sync").
# Bug (routing_counts_d2h_bug.py): the local-permutation path reads the per-expert split sizes on the
#   host but never calls _maybe_update_cuda_sync_point, so cuda_sync_point stays "no_sync" and
#   .tolist() reads the pinned counts while the non_blocking D2H copy into them is still queued.
# Fix (routing_counts_d2h_fixed.py): register the sync point, so d2h_event.synchronize() runs first.
import torch
import torch.nn.functional as F

SLEEP_CYCLES = 20_000_000  # ~10 ms; delays the D2H stream (stands in for copies queued behind a2a traffic)
H, FFN, E, T, LAYERS = 256, 512, 8, 2048, 2
DEV = torch.device("cuda:0")


class AlltoAllTokenDispatcher:
    cuda_dtoh_stream = None

    def __init__(self):
        self.cuda_sync_point = "no_sync"
        self.cuda_dtoh_point = "before_permutation_1"
        self.cuda_sync_point_priority = {
            "before_permutation_1": 0,
            "before_ep_alltoall": 1,
            "before_permutation_2": 2,
            "before_finish": 3,
            "no_sync": 4,
        }
        # pinned landing buffer for the per-expert counts, reused every layer
        self.tokens_per_expert_cpu = torch.zeros(E, dtype=torch.int64).pin_memory()
        self.d2h_event = None
        if AlltoAllTokenDispatcher.cuda_dtoh_stream is None:
            AlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()

    def _maybe_update_cuda_sync_point(self, point):
        if self.cuda_sync_point_priority[point] < self.cuda_sync_point_priority[self.cuda_sync_point]:
            self.cuda_sync_point = point

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if point == self.cuda_dtoh_point:
            self.cuda_dtoh_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.cuda_dtoh_stream):
                torch.cuda._sleep(SLEEP_CYCLES)
                self.tokens_per_expert_cpu.copy_(tokens_per_expert, non_blocking=True)
                tokens_per_expert.record_stream(self.cuda_dtoh_stream)
            self.d2h_event = self.cuda_dtoh_stream.record_event()
        if point == self.cuda_sync_point:
            self.d2h_event.synchronize()

    def preprocess(self, top_expert):
        tokens_per_expert = torch.zeros(E, dtype=torch.int64, device=top_expert.device)
        tokens_per_expert.scatter_add_(0, top_expert, torch.ones_like(top_expert))  # no host sync
        return tokens_per_expert

    def dispatch_and_compute(self, hidden, top_expert, top_prob, w1, w2):
        tokens_per_expert = self.preprocess(top_expert)
        self._maybe_dtoh_and_synchronize("before_permutation_1", tokens_per_expert)
        splits = self.tokens_per_expert_cpu.tolist()  # host read of the pinned counts

        order = torch.argsort(top_expert, stable=True)
        permuted = hidden.index_select(0, order)
        expert_out = torch.zeros_like(permuted)
        start = 0
        for e, n in enumerate(splits):  # grouped-GEMM stand-in: one GEMM per host split
            if n > 0:
                chunk = permuted[start:start + n]
                expert_out[start:start + n] = F.silu(chunk @ w1[e]) @ w2[e]
            start += n
        out = torch.empty_like(hidden)
        out[order] = expert_out * top_prob.index_select(0, order)[:, None]
        return out


def reference_layer(hidden, top_expert, top_prob, w1, w2):
    out = torch.zeros_like(hidden)
    for e in range(E):
        sel = top_expert == e
        out[sel] = F.silu(hidden[sel] @ w1[e]) @ w2[e]
    return out * top_prob[:, None]


@torch.no_grad()
def main():
    torch.manual_seed(0)
    routers = [torch.randn(H, E, device=DEV) for _ in range(LAYERS)]
    w1s = [torch.randn(E, H, FFN, device=DEV) * H ** -0.5 for _ in range(LAYERS)]
    w2s = [torch.randn(E, FFN, H, device=DEV) * FFN ** -0.5 for _ in range(LAYERS)]
    x = torch.randn(T, H, device=DEV)
    torch.cuda.synchronize()

    def route(h, layer):
        probs = torch.softmax(h @ routers[layer], dim=-1)
        top_prob, top_expert = probs.max(dim=-1)
        return top_expert, top_prob

    ref = x
    for layer in range(LAYERS):
        top_expert, top_prob = route(ref, layer)
        ref = ref + reference_layer(ref, top_expert, top_prob, w1s[layer], w2s[layer])
    torch.cuda.synchronize()

    dispatcher = AlltoAllTokenDispatcher()
    h = x
    for layer in range(LAYERS):
        top_expert, top_prob = route(h, layer)
        h = h + dispatcher.dispatch_and_compute(h, top_expert, top_prob, w1s[layer], w2s[layer])
    torch.cuda.synchronize()

    checksum = h.double().abs().sum().item()
    reference = ref.double().abs().sum().item()
    match = torch.allclose(h, ref, rtol=1e-3, atol=1e-3)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
