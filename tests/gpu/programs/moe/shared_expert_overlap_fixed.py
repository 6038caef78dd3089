# Source: NVIDIA/Megatron-LM megatron/core/transformer/moe/shared_experts.py
#   SharedExpertMLP with --moe-shared-expert-overlap: a class-level side stream (`stream = None`,
#   created once with torch.cuda.Stream()) runs pre_forward_comm / linear_fc1_forward_and_act /
#   linear_fc2_forward / get_output, with intermediates cached on the module; pre_forward_comm starts
#   with self.stream.wait_stream(current) and get_output ends with
#   torch.cuda.current_stream().wait_stream(self.stream).
# Bug (shared_expert_overlap_bug.py): get_output() hands back the cached shared-expert output without
#   the final wait_stream, so the routed + shared add on the default stream reads the fc2 output while
#   the shared-expert stream is still producing it.
# Fix (shared_expert_overlap_fixed.py): restore the join in get_output().
import torch
import torch.nn as nn
import torch.nn.functional as F

SLEEP_CYCLES = 20_000_000  # ~10 ms; delays the shared-expert stream (stands in for the TP all-gather)
H, FFN, E, T, LAYERS = 256, 512, 4, 1024, 3
DEV = torch.device("cuda:0")


class SharedExpertMLP(nn.Module):
    stream = None  # shared by all layers, like Megatron's class attribute

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(H, FFN, bias=False)
        self.fc2 = nn.Linear(FFN, H, bias=False)
        self.cached_fc1_input = None
        self.cached_fc2_input = None
        self.cached_output = None
        if SharedExpertMLP.stream is None:
            SharedExpertMLP.stream = torch.cuda.Stream()

    def forward(self, x):  # non-overlapped reference path
        return self.fc2(F.gelu(self.fc1(x)))

    def pre_forward_comm(self, x):
        assert self.cached_output is None
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            self.cached_fc1_input = x

    def linear_fc1_forward_and_act(self):
        with torch.cuda.stream(self.stream):
            self.cached_fc2_input = F.gelu(self.fc1(self.cached_fc1_input))
            self.cached_fc1_input = None

    def linear_fc2_forward(self):
        with torch.cuda.stream(self.stream):
            self.cached_output = self.fc2(self.cached_fc2_input)
            self.cached_fc2_input = None

    def get_output(self):
        output = self.cached_output
        self.cached_output = None
        # FIX: make the caller's stream wait for the shared-expert stream before it reads `output`
        torch.cuda.current_stream().wait_stream(self.stream)
        return output


class MoELayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, H, FFN) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, FFN, H) * FFN ** -0.5)
        self.shared = SharedExpertMLP()

    def routed(self, h):
        probs = torch.softmax(self.router(h), dim=-1)
        top_p, top_i = probs.topk(2, dim=-1)
        gates = torch.zeros_like(probs).scatter_(1, top_i, top_p)  # [T, E], dense top-2 gates
        out = torch.zeros_like(h)
        for e in range(E):
            out += (F.gelu(h @ self.w1[e]) @ self.w2[e]) * gates[:, e:e + 1]
        return out

    def forward_reference(self, h):
        return h + self.routed(h) + self.shared(h)

    def forward_overlapped(self, h, keep):
        # Same schedule as Megatron's alltoall dispatcher with shared_expert_overlap: the shared
        # expert pieces are interleaved with the routed path, which stays on the current stream.
        self.shared.pre_forward_comm(h)
        self.shared.linear_fc1_forward_and_act()
        routed = self.routed(h)
        self.shared.linear_fc2_forward()
        shared_out = self.shared.get_output()
        keep.append(shared_out)  # keep every shared-expert output alive until the end
        return h + routed + shared_out


@torch.no_grad()
def main():
    torch.manual_seed(0)
    layers = nn.ModuleList([MoELayer() for _ in range(LAYERS)]).to(DEV)
    x = torch.randn(T, H, device=DEV)

    ref = x
    for layer in layers:
        ref = layer.forward_reference(ref)
    torch.cuda.synchronize()

    keep = []
    h = x
    for layer in layers:
        h = layer.forward_overlapped(h, keep)
        keep.append(h)
    torch.cuda.synchronize()

    checksum = h.double().abs().sum().item()
    reference = ref.double().abs().sum().item()
    match = torch.allclose(h, ref, rtol=1e-3, atol=1e-3)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
