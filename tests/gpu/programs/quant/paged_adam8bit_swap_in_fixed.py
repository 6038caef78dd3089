# Source: tascj/offload_adam, src/offload_adam/offload_adam.py OffloadAdam._issue_h2d / _issue_d2h (earlier
#   issue_h2d_transfer / issue_d2h_transfer): optimizer states kept in pinned host memory, swapped in per
#   parameter on self.h2d_stream after `self.h2d_stream.wait_stream(main_stream)`, swapped out with a d2h event
#   that is synchronized before the next swap-in of that parameter (here the swap-out runs on the main stream),
#   combined with bitsandbytes-style 8-bit blockwise optimizer states (bitsandbytes/optim/optimizer.py
#   Optimizer8bit: state1/state2 as uint8 codes into a signed/unsigned quantization map, absmax1/absmax2 per
#   256-element block, optimizer_update_8bit_blockwise). Emulated with torch ops.
# Bug: issue_h2d_transfer() allocates the device state buffers with torch.empty on the main (default) stream
#   and fills them on h2d_stream, but drops the `h2d_stream.wait_stream(main_stream)`. The caching allocator
#   hands parameter i+1's state buffers the blocks that parameter i's states (and update temporaries) just
#   released; those are free for the main stream, whose 8-bit update and swap-out of parameter i are still
#   queued, but h2d_stream never waited for them, so the H2D copy overwrites them before the main stream
#   reads them. Race (allocation reuse): h2d_stream write (H2D copy into the newly allocated state1/absmax1/
#   state2/absmax2 buffers) vs the main stream's pending reads/writes of the previous life of those blocks.
# Fix: h2d_stream.wait_stream(torch.cuda.current_stream()) before issuing the copies, as OffloadAdam does.
import torch

DEV = "cuda:0"
BLOCK = 256
HIDDEN = 1024
N_LAYERS = 4
STEPS = 3
UPDATE_CYCLES = 10_000_000  # the fused 8-bit update kernel over a large tensor

SIGNED_MAP = torch.linspace(-1.0, 1.0, 256, device=DEV) ** 3
UNSIGNED_MAP = torch.linspace(0.0, 1.0, 256, device=DEV) ** 3


def quantize_blockwise(x, code):
    blocks = x.reshape(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1).clamp(min=1e-12)
    mid = (code[1:] + code[:-1]) / 2
    idx = torch.bucketize((blocks / absmax[:, None]).reshape(-1), mid)
    return idx.to(torch.uint8), absmax


def dequantize_blockwise(codes, absmax, code):
    return (code[codes.long()].view(-1, BLOCK) * absmax[:, None]).reshape(-1)


class PagedAdamW8bit:
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.h2d_stream = torch.cuda.Stream()
        self.d2h_events = {}
        self.step_count = 0
        self.host_states = {}
        for p in self.params:
            n = p.numel()
            self.host_states[p] = {
                "state1": torch.full((n,), 127, dtype=torch.uint8).pin_memory(),  # code index of ~0.0
                "absmax1": torch.zeros(n // BLOCK).pin_memory(),
                "state2": torch.zeros(n, dtype=torch.uint8).pin_memory(),
                "absmax2": torch.zeros(n // BLOCK).pin_memory(),
            }

    def issue_h2d_transfer(self, p):
        main_stream = torch.cuda.current_stream()
        if p in self.d2h_events:
            self.d2h_events[p].synchronize()
        host = self.host_states[p]
        dev = {k: torch.empty(v.shape, dtype=v.dtype, device=DEV) for k, v in host.items()}
        self.h2d_stream.wait_stream(main_stream)  # FIX: blocks allocated on main may still be in use there
        with torch.cuda.stream(self.h2d_stream):
            for k, v in host.items():
                dev[k].copy_(v, non_blocking=True)
        return dev, self.h2d_stream.record_event()

    def issue_d2h_transfer(self, p, dev):
        for k, v in self.host_states[p].items():
            v.copy_(dev[k], non_blocking=True)
        self.d2h_events[p] = torch.cuda.current_stream().record_event()

    def update_8bit_blockwise(self, p, dev):
        b1, b2 = self.betas
        g = p.grad.reshape(-1)
        m = dequantize_blockwise(dev["state1"], dev["absmax1"], SIGNED_MAP)
        v = dequantize_blockwise(dev["state2"], dev["absmax2"], UNSIGNED_MAP)
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        flat = p.data.view(-1)
        flat.mul_(1 - self.lr * self.wd)
        denom = (v / (1 - b2 ** self.step_count)).sqrt_().add_(self.eps)
        flat.addcdiv_(m, denom, value=-self.lr / (1 - b1 ** self.step_count))
        for (ck, ak), x, code in ((("state1", "absmax1"), m, SIGNED_MAP), (("state2", "absmax2"), v, UNSIGNED_MAP)):
            codes, absmax = quantize_blockwise(x, code)
            dev[ck].copy_(codes)
            dev[ak].copy_(absmax)

    @torch.no_grad()
    def step(self):
        self.step_count += 1
        for p in self.params:
            dev, h2d_done = self.issue_h2d_transfer(p)
            torch.cuda.current_stream().wait_event(h2d_done)
            torch.cuda._sleep(UPDATE_CYCLES)
            self.update_8bit_blockwise(p, dev)
            self.issue_d2h_transfer(p, dev)
            del dev  # device copies of the states are released; the host copy is authoritative


class SyncPagedAdamW8bit(PagedAdamW8bit):
    """Reference: swap-in on the main stream with a blocking copy."""

    def issue_h2d_transfer(self, p):
        if p in self.d2h_events:
            self.d2h_events[p].synchronize()
        dev = {k: v.to(DEV) for k, v in self.host_states[p].items()}
        return dev, torch.cuda.current_stream().record_event()


def train(model, opt, inputs):
    losses = []
    for x in inputs:
        loss = model(x).float().pow(2).mean()
        loss.backward()
        losses.append(loss.item())  # logging: host waits for the backward
        opt.step()
        for p in model.parameters():
            p.grad = None
    return losses


def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(N_LAYERS)]).to(DEV)
    ref_model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(N_LAYERS)]).to(DEV)
    ref_model.load_state_dict(model.state_dict())
    inputs = torch.randn(STEPS, 512, HIDDEN, device=DEV)

    losses = train(model, PagedAdamW8bit(model.parameters()), inputs)
    torch.cuda.synchronize()
    ref_losses = train(ref_model, SyncPagedAdamW8bit(ref_model.parameters()), inputs)
    torch.cuda.synchronize()

    ok = all(torch.allclose(p, q, rtol=1e-6, atol=1e-7) for p, q in zip(model.parameters(), ref_model.parameters()))
    d = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref_model.parameters()))
    print(f"losses={[round(l, 6) for l in losses]} ref={[round(l, 6) for l in ref_losses]} max|dp|={d:.3g}")
    print(f"match={ok}")


if __name__ == "__main__":
    main()
