# Source: plausible pattern modelled on colocated RL weight sync (verl's
# FSDP -> rollout sharding manager feeding a per-tensor generator into the
# engine's model.load_weights, OpenRLHF / TRL "sync weights to vLLM"): the
# trainer's fp32 parameters are gathered / cast to the rollout dtype on a
# dedicated sync stream and handed one by one to the inference engine, whose
# load_weights copies them into its own parameters on the engine's (default)
# stream after waiting for a per-tensor ready event.
#
# Race (missing record_stream): each bf16 temporary `full` is allocated on
# self.sync_stream but read by the engine's copy_ on the default stream. When the
# generator moves on, `full` is dropped and its block returns to the sync
# stream's pool; the cast of a later parameter of the same size (two layers on)
# is handed that block and overwrites it while the engine's copy_, queued
# behind the rollout still running on the default stream, has not read it yet
# -> the engine loads another layer's weights.
# Fix: full.record_stream(engine_stream) before handing the tensor over.
import torch
import torch.nn as nn

DEV = "cuda:0"
H, LAYERS, ITERS, B = 2048, 8, 3, 64
SLEEP_CYCLES = 4_000_000  # ~2 ms GPU busy-wait: rollout still generating


def make_mlp(dtype):
    return nn.Sequential(*[nn.Linear(H, H, bias=False) for _ in range(LAYERS)]).to(DEV, dtype)


class WeightSyncer:
    def __init__(self):
        self.sync_stream = torch.cuda.Stream()

    def _iter_full_params(self, trainer):
        for name, p in trainer.named_parameters():
            with torch.cuda.stream(self.sync_stream):
                full = p.detach().to(torch.bfloat16)  # (FSDP: all-gather + cast)
                ready = torch.cuda.Event()
                ready.record()
            yield name, full, ready

    @torch.no_grad()
    def sync(self, trainer, engine, train_stream):
        engine_stream = torch.cuda.current_stream()
        self.sync_stream.wait_stream(train_stream)  # optimizer step finished
        params = dict(engine.named_parameters())
        for name, full, ready in self._iter_full_params(trainer):
            engine_stream.wait_event(ready)
            # BUG: `full` lives in sync_stream's pool but is read on engine_stream.
            params[name].copy_(full)  # engine load_weights, on the engine's stream
        # the trainer may update its parameters again only after they were read
        train_stream.wait_stream(self.sync_stream)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    trainer = make_mlp(torch.float32)
    engine = make_mlp(torch.bfloat16).requires_grad_(False)
    for pe, pt in zip(engine.parameters(), trainer.parameters()):
        pe.copy_(pt)
    grads = [torch.randn_like(p) * 0.01 for p in trainer.parameters()]
    prompts = torch.randn(ITERS + 1, B, H, device=DEV, dtype=torch.bfloat16)
    acc = torch.zeros((), dtype=torch.float64, device=DEV)

    train_stream = torch.cuda.Stream()
    train_stream.wait_stream(torch.cuda.current_stream())
    syncer = WeightSyncer()
    for it in range(ITERS):
        # rollout: generation still running on the engine's (default) stream
        torch.cuda._sleep(SLEEP_CYCLES)
        acc += engine(prompts[it]).double().sum()
        # trainer update on the training stream, overlapping the rollout
        with torch.cuda.stream(train_stream):
            for p, g in zip(trainer.parameters(), grads):
                p.add_(g, alpha=-(it + 1))
        syncer.sync(trainer, engine, train_stream)
    # final rollout with the last synced weights
    acc += engine(prompts[ITERS]).double().sum()
    for i, p in enumerate(engine.parameters()):
        acc += p.double().sum() * (i + 1)
    torch.cuda.current_stream().wait_stream(train_stream)
    torch.cuda.synchronize()
    print(f"rl_weight_sync_cast checksum: {acc.item():.6f}")


if __name__ == "__main__":
    main()
