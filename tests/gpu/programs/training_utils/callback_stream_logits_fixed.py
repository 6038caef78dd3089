# Case: callback_stream_logits (FIXED version)
# Source: plausible pattern. A Lightning-style callback (hooks on_train_batch_start /
# on_train_batch_end(outputs, ...), as in lightning.pytorch.Callback) computes prediction
# statistics (entropy, confidence) on its own CUDA stream so logging does not slow the
# step down. The minimal trainer loop below mirrors Lightning's fit loop: hooks around
# training_step, then the step outputs are dropped.
# Fix: on_train_batch_start makes the default stream wait for the callback stream before
# the next training step allocates anything, so the freed logits block is only reused
# after the callback kernels that read it (no record_stream needed).
import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda:0")


class PredictionStatsCallback:
    def __init__(self):
        self.stream = torch.cuda.Stream(device=DEV)
        self.sums = torch.zeros(2, device=DEV)  # entropy, max-prob
        self.count = 0

    def on_train_batch_start(self, trainer, batch, batch_idx):
        torch.cuda.current_stream().wait_stream(self.stream)  # FIX

    @torch.no_grad()
    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        logits = outputs["logits"].detach()
        self.stream.wait_stream(torch.cuda.current_stream())  # logits are ready
        with torch.cuda.stream(self.stream):
            probs = logits.softmax(dim=-1)
            ent = -(probs * probs.clamp_min(1e-12).log()).sum(dim=-1).mean()
            conf = probs.amax(dim=-1).mean()
            self.sums += torch.stack([ent, conf])
        self.count += 1

    def on_train_end(self, trainer):
        torch.cuda.synchronize()
        s = (self.sums / self.count).tolist()
        print("mean entropy %.4f  mean confidence %.4f" % (s[0], s[1]))


class LitClassifier(nn.Module):
    def __init__(self, d=512, n_cls=1000):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 1024), nn.ReLU(), nn.Linear(1024, n_cls))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, y), "logits": logits}


class MiniTrainer:
    def __init__(self, callbacks):
        self.callbacks = callbacks

    def fit(self, module, opt, batches):
        for idx, batch in enumerate(batches):
            for cb in self.callbacks:
                cb.on_train_batch_start(self, batch, idx)
            opt.zero_grad(set_to_none=True)
            outputs = module.training_step(batch, idx)
            outputs["loss"].backward()
            opt.step()
            for cb in self.callbacks:
                cb.on_train_batch_end(self, outputs, batch, idx)
            del outputs  # last reference to this step's logits
        for cb in self.callbacks:
            cb.on_train_end(self)


def main():
    torch.manual_seed(0)
    module = LitClassifier().to(DEV)
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9, foreach=True)
    g = torch.Generator().manual_seed(12)
    # GPU-resident dataset: batches are created once, before training
    batches = [(torch.randn(512, 512, generator=g).to(DEV),
                torch.randint(0, 1000, (512,), generator=g).to(DEV)) for _ in range(8)]
    cb = PredictionStatsCallback()
    torch.cuda.synchronize()
    MiniTrainer([cb]).fit(module, opt, batches)


if __name__ == "__main__":
    main()
