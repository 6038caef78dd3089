# Source: modelled on Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication
# (megatron/core/tensor_parallel/layers.py): with gradient_accumulation_fusion the
# weight gradient is accumulated straight into an fp32 `weight.main_grad` buffer and
# the Function returns None for the weight. Here the wgrad GEMM is additionally moved
# to a side stream so it overlaps with the rest of backward (the "overlap wgrad"
# idea of TE/Megatron delayed-wgrad). The side-stream part is a plausible variant,
# not a specific upstream issue; the record_stream rule is the one in PyTorch's
# CUDA-semantics notes (same hazard as torchtune#1867 / prime-rl PR #3109 review).
# BUG: grad_output and the saved input are caching-allocator blocks of the default
# stream that the side stream reads, but nobody calls record_stream(side) before
# autograd drops them, and the default stream keeps allocating during backward.
import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda", 0)


class LinearWgradOnSideStream(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, side_stream):
        ctx.save_for_backward(x, weight)
        ctx.side_stream = side_stream
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_in = grad_out @ weight                      # dgrad on the compute stream
        side = ctx.side_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # wgrad, accumulated into the fp32 main_grad (gradient accumulation fusion)
            weight.main_grad.addmm_(grad_out.t(), x)
        return grad_in, None, None


class FusedLinear(nn.Module):
    def __init__(self, d_in, d_out, side_stream):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)
        self.side_stream = side_stream

    def allocate_main_grad(self):
        self.weight.main_grad = torch.zeros_like(self.weight, dtype=torch.float32)

    def forward(self, x):
        return LinearWgradOnSideStream.apply(x, self.weight, self.side_stream)


class MLP(nn.Module):
    def __init__(self, d=1024, layers=3):
        super().__init__()
        self.wgrad_stream = torch.cuda.Stream(device=DEV)
        self.layers = nn.ModuleList(FusedLinear(d, d, self.wgrad_stream) for _ in range(layers))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = F.relu(x)
        return x


def sgd_step_on_main_grad(model, lr):
    # the optimizer consumes main_grad, so it must see the side-stream wgrads
    torch.cuda.current_stream().wait_stream(model.wgrad_stream)
    with torch.no_grad():
        for layer in model.layers:
            layer.weight.add_(layer.weight.main_grad, alpha=-lr)
            layer.weight.main_grad.zero_()


def main():
    torch.manual_seed(0)
    model = MLP().to(DEV)
    for layer in model.layers:
        layer.allocate_main_grad()
    torch.cuda.synchronize()
    for step in range(3):
        x = torch.randn(2048, 1024, device=DEV)
        target = torch.randn(2048, 1024, device=DEV)
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        sgd_step_on_main_grad(model, lr=1e-3)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
