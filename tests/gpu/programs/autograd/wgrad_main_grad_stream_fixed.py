# Source: NVIDIA Megatron-LM megatron/core/tensor_parallel/layers.py,
#         LinearWithGradAccumulationAndAsyncCommunication.backward: with gradient_accumulation_fusion the
#         weight gradient is accumulated straight into weight.main_grad (fp32) inside the custom
#         autograd.Function backward and no gradient is returned for the weight.
# Pattern: the wgrad GEMM is moved onto a dedicated stream so it overlaps with the dgrad GEMMs of the
# earlier layers. The autograd engine only syncs the caller's stream with the streams of its own leaf
# nodes at the end of backward(); it knows nothing about WGRAD_STREAM.
import torch

SLEEP = 20_000_000
dev = torch.device("cuda")
torch.manual_seed(0)

WGRAD_STREAM = torch.cuda.Stream()


class LinearMainGradAccum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, main_grad):
        ctx.save_for_backward(x, weight)
        ctx.main_grad = main_grad
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        cur = torch.cuda.current_stream()
        grad_in = grad_out @ weight  # dgrad on the backward stream
        WGRAD_STREAM.wait_stream(cur)  # grad_out and x are ready
        grad_out.record_stream(WGRAD_STREAM)  # both are released when this node returns
        x.record_stream(WGRAD_STREAM)
        with torch.cuda.stream(WGRAD_STREAM):
            torch.cuda._sleep(SLEEP)  # wgrad GEMM queued behind other side-stream work
            ctx.main_grad.addmm_(grad_out.t(), x)  # fused accumulation into main_grad
        return grad_in, None, None


class TinyMLP:
    def __init__(self, dims):
        self.weights = []
        for d_in, d_out in zip(dims[:-1], dims[1:]):
            w = (torch.randn(d_out, d_in, device=dev) / d_in**0.5).requires_grad_()
            w.main_grad = torch.zeros_like(w)
            self.weights.append(w)

    def forward(self, x):
        for i, w in enumerate(self.weights):
            x = LinearMainGradAccum.apply(x, w, w.main_grad)
            if i + 1 < len(self.weights):
                x = torch.tanh(x)
        return x


def train_step(model, x, y, lr):
    loss = (model.forward(x) - y).pow(2).mean()
    loss.backward()
    # FIX: backward() does not know WGRAD_STREAM; order the optimizer after the main_grad accumulation.
    torch.cuda.current_stream().wait_stream(WGRAD_STREAM)
    with torch.no_grad():
        for w in model.weights:
            w.sub_(lr * w.main_grad)  # optimizer step reads main_grad on the default stream


dims = [1024, 1024, 1024, 1024]
model = TinyMLP(dims)
init = [w.detach().clone() for w in model.weights]
x = torch.randn(2048, dims[0], device=dev)
y = torch.randn(2048, dims[-1], device=dev)
LR = 0.5

train_step(model, x, y, LR)
torch.cuda.synchronize()
checksum = sum(w.double().sum().item() + w.main_grad.double().abs().sum().item() for w in model.weights)

# Reference: plain autograd on the default stream.
ref_w = [w.clone().requires_grad_() for w in init]
h = x
for i, w in enumerate(ref_w):
    h = h @ w.t()
    if i + 1 < len(ref_w):
        h = torch.tanh(h)
(h - y).pow(2).mean().backward()
with torch.no_grad():
    reference = sum((w - LR * w.grad).double().sum().item() + w.grad.double().abs().sum().item() for w in ref_w)

torch.cuda.synchronize()
match = abs(checksum - reference) <= 1e-4 * abs(reference) + 1e-4
print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")
