# Structure: vLLM PR #41785 "[LoRA][Perf] Overlap LoRA weight H2D copies with
# compute via side CUDA stream" (LoRAOverlapLoader: activate_adapter() copies
# go on a dedicated side stream; the default stream waits on a CUDA event
# before the next forward).  Plausible pattern, not a reported issue: when an
# adapter is evicted from a GPU slot, the side stream must also wait for the
# forward passes still reading that slot.  FIXED: the default (compute) stream
# is captured *before* entering `with torch.cuda.stream(self.load_stream)`, so
# load_stream.wait_stream() really waits for the compute stream.
from collections import OrderedDict

import torch

DEV = torch.device("cuda:0")
HIDDEN, RANK, MAX_LORAS, NUM_ADAPTERS, TOKENS_PER_REQ, NUM_STEPS = 2048, 16, 2, 4, 64, 8


class CPULoRACache:  # adapters already loaded from disk into pinned host memory
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.weights = {}
        for lora_id in range(NUM_ADAPTERS):
            a = (torch.randn(RANK, HIDDEN, generator=g) * 0.01).pin_memory()
            b = (torch.randn(HIDDEN, RANK, generator=g) * 0.01).pin_memory()
            self.weights[lora_id] = (a, b)


class LoRAModelManager:
    def __init__(self, cpu_cache):
        self.cpu_cache = cpu_cache
        self.lora_a_stacked = torch.zeros(MAX_LORAS, RANK, HIDDEN, device=DEV)
        self.lora_b_stacked = torch.zeros(MAX_LORAS, HIDDEN, RANK, device=DEV)
        self.slot_of = OrderedDict()  # lora_id -> slot, in LRU order
        self.load_stream = torch.cuda.Stream()
        self.load_event = torch.cuda.Event()

    def _pick_slot(self, active_ids):
        if len(self.slot_of) < MAX_LORAS:
            return len(self.slot_of)
        for victim in self.slot_of:  # least recently used, not needed now
            if victim not in active_ids:
                return self.slot_of.pop(victim)
        raise RuntimeError("no free LoRA slot")

    def activate_adapter(self, lora_id, active_ids):
        slot = self._pick_slot(active_ids)
        a_cpu, b_cpu = self.cpu_cache.weights[lora_id]
        compute_stream = torch.cuda.current_stream()  # FIX: captured outside
        with torch.cuda.stream(self.load_stream):
            # Make sure in-flight forwards are done with the evicted slot.
            self.load_stream.wait_stream(compute_stream)
            self.lora_a_stacked[slot].copy_(a_cpu, non_blocking=True)
            self.lora_b_stacked[slot].copy_(b_cpu, non_blocking=True)
            self.load_event.record()
        self.slot_of[lora_id] = slot

    def set_active_adapters(self, lora_ids):
        for lora_id in lora_ids:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
            else:
                self.activate_adapter(lora_id, set(lora_ids))
        # Default stream waits for the H2D copies before the forward.
        torch.cuda.current_stream().wait_event(self.load_event)
        return [self.slot_of[i] for i in lora_ids]


class LoRALinear:
    def __init__(self, manager):
        g = torch.Generator(device=DEV).manual_seed(1)
        self.weight = torch.randn(HIDDEN, HIDDEN, device=DEV, generator=g) * 0.02
        self.m = manager

    def forward(self, x, token_lora_indices):
        y = x @ self.weight
        a = self.m.lora_a_stacked.index_select(0, token_lora_indices)  # [T, r, H]
        b = self.m.lora_b_stacked.index_select(0, token_lora_indices)  # [T, H, r]
        shrink = torch.bmm(a, x.unsqueeze(-1))                         # [T, r, 1]
        return y + torch.bmm(b, shrink).squeeze(-1)


def build_token_lora_indices(slots):
    # Built on the GPU (no pageable H2D copy, no implicit sync).
    return torch.cat([torch.full((TOKENS_PER_REQ,), s, dtype=torch.int64, device=DEV)
                      for s in slots])


def main():
    manager = LoRAModelManager(CPULoRACache())
    layer = LoRALinear(manager)
    g = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(2 * TOKENS_PER_REQ, HIDDEN, device=DEV, generator=g)
    torch.cuda.synchronize()  # engine start-up done
    outs = []
    for step in range(NUM_STEPS):
        # Each step serves two requests; adapter set slides, forcing evictions.
        lora_ids = [step % NUM_ADAPTERS, (step + 1) % NUM_ADAPTERS]
        slots = manager.set_active_adapters(lora_ids)
        idx = build_token_lora_indices(slots)
        x = torch.tanh(layer.forward(x, idx))
        outs.append(x[:, :4])
    torch.cuda.synchronize()
    print("out:", torch.stack(outs).sum().item())


if __name__ == "__main__":
    main()
