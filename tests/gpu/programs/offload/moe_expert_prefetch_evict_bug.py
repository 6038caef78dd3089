# Source: plausible pattern modelled on MoE expert offloading with next-layer
#   prefetch (MoE-Infinity; dvmazur/mixtral-offloading ExpertCache: experts
#   live in pinned CPU memory and are copied into a fixed set of GPU expert
#   slots on a side stream).  Same hazard as pytorch/FBGEMM issue #1201
#   ("Latter prefetch may evict previous prefetched embeddings": prefetch_2
#   for compute_2 evicts data still used by compute_1).
# Race (bug version): GPU expert slots are double-buffered by layer parity.
#   While layer l computes on the default stream, the experts predicted for
#   layer l+1 are copied into the other slot set on the prefetch stream.  That
#   slot set was used by layer l-1, but the prefetch stream never waits for
#   layer l-1's expert GEMMs to finish, so the H2D copies can overwrite expert
#   weights that layer l-1 is still reading (device-device WAR between the
#   default stream and the prefetch stream).
# Fix: record an event on the compute stream after the layer that used a slot
#   set, and make the prefetch stream wait on it before overwriting the slots.
import torch

SPIN = 20_000_000  # torch.cuda._sleep cycles (~10 ms on H200)


class ExpertPrefetcher:
    def __init__(self, cpu_experts, top_k):
        self.cpu_experts = cpu_experts  # pinned [L, E, D, D]
        _, _, D, F = cpu_experts.shape
        self.slots = [torch.empty(top_k, D, F, device="cuda") for _ in range(2)]
        self.loaded = [torch.cuda.Event() for _ in range(2)]
        self.released = [torch.cuda.Event() for _ in range(2)]
        self.stream = torch.cuda.Stream()

    def prefetch(self, layer, expert_ids):
        s = layer % 2
        with torch.cuda.stream(self.stream):
            # (missing: self.stream.wait_event(self.released[s]))
            for k, e in enumerate(expert_ids):
                self.slots[s][k].copy_(self.cpu_experts[layer, e], non_blocking=True)
            self.loaded[s].record(self.stream)

    def get(self, layer):
        s = layer % 2
        torch.cuda.current_stream().wait_event(self.loaded[s])
        return self.slots[s]

    def release(self, layer):
        self.released[layer % 2].record(torch.cuda.current_stream())


def moe_layer(h, experts, router):
    gates = torch.softmax(h @ router, dim=-1)  # [T, top_k] over the loaded experts
    out = torch.zeros_like(h)
    for k in range(experts.shape[0]):
        out += gates[:, k : k + 1] * torch.tanh(h @ experts[k])
    return h + out


def main():
    torch.manual_seed(0)
    T, D, L, E, TOPK, STEPS = 1024, 1024, 6, 8, 2, 3
    cpu_experts = (torch.randn(L, E, D, D) / D**0.5).pin_memory()
    routers = [torch.randn(D, TOPK, device="cuda") / D**0.5 for _ in range(L)]
    # expert ids per layer come from an activation predictor (host side)
    routes = [torch.randperm(E)[:TOPK].tolist() for _ in range(L)]
    tokens = [torch.randn(T, D, device="cuda") for _ in range(STEPS)]

    gpu_experts = cpu_experts.cuda()
    ref = []
    for h in tokens:
        for layer in range(L):
            h = moe_layer(h, gpu_experts[layer, routes[layer]], routers[layer])
        ref.append(h)
    torch.cuda.synchronize()
    del gpu_experts

    pf = ExpertPrefetcher(cpu_experts, TOPK)
    outs = []
    for h in tokens:
        pf.prefetch(0, routes[0])
        for layer in range(L):
            if layer + 1 < L:
                pf.prefetch(layer + 1, routes[layer + 1])
            experts = pf.get(layer)
            torch.cuda._sleep(SPIN)  # attention of this layer keeps the GPU busy
            h = moe_layer(h, experts, routers[layer])
            pf.release(layer)
        outs.append(h)
    torch.cuda.synchronize()

    out = torch.stack(outs)
    refs = torch.stack(ref)
    checksum = out.double().sum().item()
    err = (out - refs).abs().max().item() / refs.abs().max().item()
    print(f"checksum={checksum:.8e} rel_err_vs_ref={err:.3e}",
          "OK" if err < 1e-5 else "MISMATCH")


if __name__ == "__main__":
    main()
