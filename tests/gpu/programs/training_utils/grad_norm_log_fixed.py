# Case: grad_norm_log (FIXED version)
# Source: meta-pytorch/torchrec PR #4421 ("Fix racy grad-norm reporting under VALUE/NONE
# clipping"): GradientClippingOptimizer copied the total grad norm GPU->CPU with
# non_blocking=True and read it immediately, so the logged norm was intermittently stale
# (~1e-22). This version uses the usual "log without a sync" trick: clip_grad_norm_
# returns a CUDA tensor, the logger stages it into a pinned scalar with a non_blocking
# copy and reads it later with float().
# Fix: record a CUDA event right after the non_blocking copy and synchronize on it before
# the host reads the pinned scalar.
import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda:0")


class GradNormLogger:
    def __init__(self, log_every=2):
        self.host_norm = torch.zeros((), dtype=torch.float32, pin_memory=True)
        self.log_every = log_every
        self.history = []
        self.ready = torch.cuda.Event()  # FIX

    def stage(self, total_norm):
        # asynchronous D2H so the training loop never blocks on logging
        self.host_norm.copy_(total_norm.detach(), non_blocking=True)
        self.ready.record()  # FIX

    def maybe_log(self, step):
        if step % self.log_every == 0:
            self.ready.synchronize()  # FIX: the D2H copy has completed
            self.history.append((step, float(self.host_norm)))


class TinyTransformerLM(nn.Module):
    def __init__(self, vocab=2000, d=256, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(d, vocab)

    def forward(self, tok):
        return self.out(self.enc(self.emb(tok)))


def main():
    torch.manual_seed(0)
    model = TinyTransformerLM().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    logger = GradNormLogger()
    g = torch.Generator().manual_seed(6)
    toks = [torch.randint(0, 2000, (32, 65), generator=g).to(DEV) for _ in range(6)]
    for step, t in enumerate(toks):
        opt.zero_grad(set_to_none=True)
        logits = model(t[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), t[:, 1:].reshape(-1))
        loss.backward()
        total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        logger.stage(total_norm)
        opt.step()
        logger.maybe_log(step)
    torch.cuda.synchronize()
    print("grad norms:", ["%d:%.3f" % h for h in logger.history])


if __name__ == "__main__":
    main()
