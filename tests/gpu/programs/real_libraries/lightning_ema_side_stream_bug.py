# Source: Lightning src/lightning/pytorch/callbacks/weight_averaging.py (WeightAveraging / EMAWeightAveraging:
#   on_train_batch_end -> AveragedModel.update_parameters(pl_module) after every optimizer step); user code
#   writes its own EMA Callback that runs the update (torch._foreach_lerp_) on a side stream to hide its cost.
# Bug: the callback makes the EMA stream wait for the compute stream (so it reads this step's weights), but
#   nothing makes the next optimizer step wait for the EMA stream. The EMA stream's lerp reads the live
#   parameters while the next step's optimizer.step() on the default stream already updates them in place:
#   write-after-read race on the model parameters between the default stream and the EMA stream.
# Fix: on_before_optimizer_step() makes the compute stream wait for the EMA stream before the optimizer writes
#   the parameters (forward/backward of the next step still overlap with the EMA update).
# This file: BUG version.
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError:  # standalone pytorch_lightning package
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback

SLEEP_CYCLES = 20_000_000  # ~10 ms: EMA over a large model is not free
MAX_STEPS, BATCH = 30, 128


class LitRegressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class SideStreamEMA(Callback):
    def __init__(self, decay=0.9):
        super().__init__()
        self.decay = decay

    def on_fit_start(self, trainer, pl_module):
        self.stream = torch.cuda.Stream(device=pl_module.device)
        self.live = [p.detach() for p in pl_module.parameters()]
        self.ema = [p.detach().clone() for p in pl_module.parameters()]
        # the same EMA kept on the compute stream, only for the self-check at the end
        self.check = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        compute = torch.cuda.current_stream(pl_module.device)
        self.stream.wait_stream(compute)  # this step's optimizer update is visible to the EMA stream
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            torch._foreach_lerp_(self.ema, self.live, 1.0 - self.decay)
        torch._foreach_lerp_(self.check, self.live, 1.0 - self.decay)

    def on_train_end(self, trainer, pl_module):
        torch.cuda.current_stream(pl_module.device).wait_stream(self.stream)


def main():
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(MAX_STEPS * BATCH, 64), torch.randn(MAX_STEPS * BATCH, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False, num_workers=0)
    ema = SideStreamEMA(decay=0.9)
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=MAX_STEPS, callbacks=[ema], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(LitRegressor(), train_dataloaders=loader)
    torch.cuda.synchronize()

    worst = max((e - c).abs().max().item() for e, c in zip(ema.ema, ema.check))
    ok = worst <= 1e-6
    print(f"steps={trainer.global_step} max_abs_diff={worst:.3e}")
    print(f"match={ok}")


if __name__ == "__main__":
    main()
