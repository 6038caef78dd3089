"""graphed_callable_log_stream -- FIXED version.

Pattern: training loop from the torch.cuda.make_graphed_callables docs (module graphed
with its forward/backward graphs) plus an "async logger" that copies each step's
predictions to pinned host memory on a side stream so logging never stalls training.
Graphed.forward (torch/cuda/graphs.py) returns `o.detach()` of the forward graph's
static outputs, i.e. every call returns the SAME storage, overwritten by the next
fwd_graph.replay().  The logger stream waits for the producer, but the training stream
never waits for the logger before the next replay (WAR race on the static output).
Plausible pattern; no single upstream issue.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class AsyncPredictionLogger:
    def __init__(self, steps, shape):
        self.stream = torch.cuda.Stream()
        self.host = torch.empty((steps,) + tuple(shape), pin_memory=True)

    def log(self, step, pred):
        # pred was produced by the forward replay on the training stream
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.host[step].copy_(pred.detach(), non_blocking=True)

    def collect(self):
        self.stream.synchronize()
        return self.host


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    batch, d_in, d_hidden, d_out, steps = 128, 512, 1024, 64, 8
    model = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(),
                          nn.Linear(d_hidden, d_hidden), nn.ReLU(),
                          nn.Linear(d_hidden, d_out)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    sample = torch.randn(batch, d_in, device=dev)
    model = torch.cuda.make_graphed_callables(model, (sample,))

    data = [torch.randn(batch, d_in, device=dev) for _ in range(steps)]
    target = [torch.randn(batch, d_out, device=dev) for _ in range(steps)]
    logger = AsyncPredictionLogger(steps, (batch, d_out))
    losses = []
    for step in range(steps):
        # FIX: the next replay overwrites the static output -> wait for the logger's read
        torch.cuda.current_stream().wait_stream(logger.stream)
        opt.zero_grad(set_to_none=True)
        pred = model(data[step])          # fwd graph replay writes the static output
        loss = F.mse_loss(pred, target[step])
        loss.backward()                   # bwd graph replay
        opt.step()
        logger.log(step, pred)            # side stream reads the static output
        losses.append(loss.detach())

    host_preds = logger.collect()
    torch.cuda.synchronize()
    print("losses:", [round(v, 4) for v in torch.stack(losses).tolist()])
    print("logged pred mean:", float(host_preds.mean()))


if __name__ == "__main__":
    main()
