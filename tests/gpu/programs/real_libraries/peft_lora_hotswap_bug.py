# Source: peft src/peft/utils/hotswap.py, hotswap_adapter_from_state_dict(): swaps a LoRA adapter in place
#   (old_val.data.copy_(new_val.data) into lora_A/lora_B of adapter "default"), the building block of
#   multi-tenant LoRA serving with one compiled model. User code: an adapter server that performs the swap on a
#   side stream "so that it overlaps the tail of the previous request".
# Bug: the swap stream waits for nothing before it overwrites the adapter. The previous tenant's forward pass,
#   enqueued on the default stream and still queued behind earlier GPU work, reads lora_A/lora_B of adapter
#   "default"; the swap stream's copy_ writes the same parameters with no edge from that read (write-after-read
#   race, default stream vs swap stream). The consumer side is right: the next forward waits for the swap.
# Fix: self.swap_stream.wait_stream(torch.cuda.current_stream()) before the swap, so the in-place copy runs
#   after every forward already enqueued with the old adapter.
# This file: BUG version.
import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model
from peft.utils.hotswap import hotswap_adapter_from_state_dict

DEVICE = torch.device("cuda", 0)
D_IN, D_HID, N_OUT, BATCH = 1024, 2048, 16, 256
SLEEP_CYCLES = 40_000_000  # ~20 ms: a long request (many decode steps) still occupying the GPU


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, D_HID)
        self.fc2 = nn.Linear(D_HID, D_HID)
        self.head = nn.Linear(D_HID, N_OUT)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def make_adapter_bank(model, tenants):
    """One LoRA state dict per tenant, kept resident on the GPU (keys exactly as in model.state_dict())."""
    template = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    bank = {}
    for seed, tenant in enumerate(tenants):
        g = torch.Generator().manual_seed(1000 + seed)
        bank[tenant] = {k: (torch.randn(v.shape, generator=g) * 0.05).to(DEVICE) for k, v in template.items()}
    return bank


class AdapterServer:
    def __init__(self, model, config, bank):
        self.model = model
        self.config = config
        self.bank = bank
        self.swap_stream = torch.cuda.Stream(DEVICE)
        self.active = None

    def activate(self, tenant):
        if tenant == self.active:
            return
        with torch.cuda.stream(self.swap_stream):
            hotswap_adapter_from_state_dict(self.model, self.bank[tenant], adapter_name="default",
                                            config=self.config)
        torch.cuda.current_stream().wait_stream(self.swap_stream)  # next forward sees the new adapter
        self.active = tenant

    @torch.no_grad()
    def serve(self, tenant, x):
        self.activate(tenant)
        torch.cuda._sleep(SLEEP_CYCLES)
        return self.model(x)


def main():
    torch.manual_seed(0)
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["fc1", "fc2"])
    model = get_peft_model(Classifier(), config).to(DEVICE).eval()
    tenants = ["acme", "globex", "initech"]
    bank = make_adapter_bank(model, tenants)
    requests = [(t, torch.randn(BATCH, D_IN).to(DEVICE))
                for t in ["acme", "globex", "acme", "initech", "globex", "acme"]]
    torch.cuda.synchronize()

    server = AdapterServer(model, config, bank)
    outputs = [server.serve(tenant, x) for tenant, x in requests]
    torch.cuda.synchronize()

    # Reference: swap and run one request at a time, everything on the default stream.
    ok, worst = True, 0.0
    with torch.no_grad():
        for (tenant, x), out in zip(requests, outputs):
            hotswap_adapter_from_state_dict(model, bank[tenant], adapter_name="default", config=config)
            ref = model(x)
            worst = max(worst, (ref - out).abs().max().item())
            ok = ok and torch.allclose(ref, out, rtol=1e-4, atol=1e-4)
    print(f"requests={len(outputs)} max_abs_diff={worst:.3e}")
    print(f"match={ok}")


if __name__ == "__main__":
    main()
