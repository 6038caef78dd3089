"""autograd_side_mask (bug version).

Plausible pattern, no specific issue: a dropout whose mask does not depend on the input is
generated on a side stream (to overlap the preceding GEMM) inside a custom autograd.Function,
and the side-stream mask is saved for backward.  The Tensor.record_stream docs describe exactly
this situation ("most suitable for use cases where you are providing a function that created a
tensor on a side stream, and want users to be able to make use of the tensor without having to
think carefully about stream safety"); this script omits the call.

The mask is read on the default stream in forward and backward, freed when autograd releases the
saved tensors at the end of backward, and the side stream's next allocation (next iteration's
mask) is not ordered after those reads.
"""
import torch

DEV = torch.device("cuda", 0)
B, D, STEPS, P = 4096, 4096, 4, 0.1      # each mask: 4096 x 4096 fp32 = 64 MiB


class SideStreamDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, stream):
        with torch.cuda.stream(stream):
            mask = torch.empty(x.shape, device=x.device, dtype=x.dtype)      # side stream
            mask.bernoulli_(1.0 - p).div_(1.0 - p)
        torch.cuda.current_stream(x.device).wait_stream(stream)
        ctx.save_for_backward(mask)
        return x * mask                                  # default stream reads mask

    @staticmethod
    def backward(ctx, grad_out):
        (mask,) = ctx.saved_tensors
        return grad_out * mask, None, None               # default stream reads mask


class Block(torch.nn.Module):
    def __init__(self, stream):
        super().__init__()
        self.fc = torch.nn.Linear(D, D, device=DEV)
        self.stream = stream

    def forward(self, x):
        return SideStreamDropout.apply(torch.relu(self.fc(x)), P, self.stream)


def main():
    torch.manual_seed(0)
    mask_stream = torch.cuda.Stream(DEV)
    model = torch.nn.Sequential(Block(mask_stream), Block(mask_stream))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs = [torch.randn(B, D, device=DEV) for _ in range(STEPS)]
    total = torch.zeros((), device=DEV)
    for x in xs:
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()                                  # saved masks are freed in here
        opt.step()
        total += loss.detach()
    torch.cuda.synchronize()
    print("mean loss", round(total.item() / STEPS, 5))


if __name__ == "__main__":
    main()
