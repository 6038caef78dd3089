# Source: pytorch/pytorch issue #33909 and PR #60230 (the engine records cross-stream uses of gradients
#         it moves between its own streams; work a user hook launches on another stream is invisible to
#         it) and meta-pytorch/torchrec PR #4231 (NaNs from a side-stream copy whose source was freed
#         without record_stream). Pipeline engines send the activation gradient of a stage boundary
#         to the previous stage on a dedicated (high-priority) p2p stream.
# Pattern: a Tensor.register_hook on the stage-boundary activation copies the incoming gradient into
# the receive buffer of the previous stage on p2p_stream. The hook returns None, so the gradient
# flows on into stage-0 backward and is released there.
import torch

SLEEP = 20_000_000
dev = torch.device("cuda")
torch.manual_seed(0)


class StageBoundary:
    def __init__(self, n_microbatches, shape):
        self.p2p_stream = torch.cuda.Stream(priority=-1)
        self.recv_bufs = [torch.empty(shape, device=dev) for _ in range(n_microbatches)]
        self.sent = []

    def attach(self, act, mb):
        act.register_hook(lambda grad: self._send(grad, mb))

    def _send(self, grad, mb):
        cur = torch.cuda.current_stream()
        self.p2p_stream.wait_stream(cur)  # grad has been produced on the backward stream
        with torch.cuda.stream(self.p2p_stream):
            torch.cuda._sleep(SLEEP)  # the link is still busy with the previous transfer
            self.recv_bufs[mb].copy_(grad)  # "isend" of the boundary gradient
            self.sent.append(self.p2p_stream.record_event())
        # FIX: grad is freed on the backward stream right after this hook; tell the allocator p2p_stream uses it.
        grad.record_stream(self.p2p_stream)


B = D = 1024
N_MB = 2
W = [(torch.randn(D, D, device=dev) / D**0.5).requires_grad_() for _ in range(4)]
xs = [torch.randn(B, D, device=dev) for _ in range(N_MB)]


def stage0(x, w):
    return torch.tanh(torch.tanh(x @ w[0]) @ w[1])


def stage1(a, w):
    return torch.tanh(a @ w[2]) @ w[3]


boundary = StageBoundary(N_MB, (B, D))
for mb in range(N_MB):
    a = stage0(xs[mb], W)
    boundary.attach(a, mb)
    stage1(a, W).pow(2).mean().backward()
for ev in boundary.sent:
    ev.synchronize()
checksum = sum(buf.double().abs().sum().item() for buf in boundary.recv_bufs)

# Reference: the boundary gradients computed directly with autograd.grad.
torch.cuda.synchronize()
reference = 0.0
for mb in range(N_MB):
    a = stage0(xs[mb], W)
    (g,) = torch.autograd.grad(stage1(a, W).pow(2).mean(), a)
    reference += g.double().abs().sum().item()

torch.cuda.synchronize()
match = abs(checksum - reference) <= 1e-4 * abs(reference) + 1e-6
print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")
