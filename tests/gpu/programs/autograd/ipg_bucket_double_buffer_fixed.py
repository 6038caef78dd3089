# Source: microsoft/DeepSpeed deepspeed/runtime/zero/stage_1_and_2.py
#         (reduce_independent_p_g_buckets_and_remove_grads: each ready grad is copied into
#         ipg_buffer[ipg_index], a full bucket is reduced on reduction_stream and ipg_index flips between
#         two buffers) and the data race reported in DeepSpeed issue #5545 / PR #3727 / PR #5606: a bucket
#         is refilled on the compute stream while the reduction stream is still reading it.
# Pattern: register_post_accumulate_grad_hook copies every finished .grad into a double-buffered
# bucket and drops the grad; full buckets are "all-reduced" into fp32 master grads on a side stream.
# The two bucket buffers are a user-level pool: the caching allocator never sees them change owner.
import torch

SLEEP = 20_000_000
dev = torch.device("cuda")
torch.manual_seed(0)
D, LAYERS, PARAMS_PER_BUCKET = 512, 6, 2


class DoubleBufferedGradReducer:
    def __init__(self, params):
        numel = params[0].numel()
        self.bucket_numel = PARAMS_PER_BUCKET * numel
        self.buffers = [torch.empty(self.bucket_numel, device=dev) for _ in range(2)]
        self.reduced = [torch.cuda.Event(), torch.cuda.Event()]  # "reduction stream done with buffer i"
        self.index = 0
        self.fill = 0
        self.in_bucket = []
        self.reduction_stream = torch.cuda.Stream()
        self.master_grads = {p: torch.zeros(numel, device=dev) for p in params}
        for p in params:
            p.register_post_accumulate_grad_hook(self.on_grad_ready)

    def on_grad_ready(self, p):
        cur = torch.cuda.current_stream()
        buf = self.buffers[self.index]
        # FIX: the buffer may still be read by the previous reduction of this bucket; wait before refilling.
        cur.wait_event(self.reduced[self.index])
        n = p.numel()
        buf[self.fill : self.fill + n].copy_(p.grad.view(-1))
        self.in_bucket.append((p, self.fill))
        self.fill += n
        p.grad = None  # "remove_grads": the bucket now holds the gradient
        if self.fill == self.bucket_numel:
            self.reduce_bucket(cur)

    def reduce_bucket(self, cur):
        buf = self.buffers[self.index]
        self.reduction_stream.wait_stream(cur)  # the bucket copies are done
        with torch.cuda.stream(self.reduction_stream):
            torch.cuda._sleep(SLEEP)  # the all-reduce of the bucket
            for p, off in self.in_bucket:
                self.master_grads[p].add_(buf[off : off + p.numel()])
            self.reduced[self.index].record(self.reduction_stream)
        self.in_bucket = []
        self.fill = 0
        self.index = 1 - self.index

    def finish(self):
        torch.cuda.current_stream().wait_stream(self.reduction_stream)


weights = [(torch.randn(D, D, device=dev) / D**0.5).requires_grad_() for _ in range(LAYERS)]
ref_w = [w.detach().clone().requires_grad_() for w in weights]
x = torch.randn(2048, D, device=dev)


def loss_fn(ws):
    h = x
    for w in ws:
        h = torch.tanh(h @ w)
    return h.pow(2).mean()


reducer = DoubleBufferedGradReducer(weights)
loss_fn(weights).backward()
reducer.finish()
checksum = sum(reducer.master_grads[w].double().abs().sum().item() for w in weights)

# Reference: plain autograd on the default stream.
torch.cuda.synchronize()
loss_fn(ref_w).backward()
reference = sum(w.grad.double().abs().sum().item() for w in ref_w)

torch.cuda.synchronize()
match = abs(checksum - reference) <= 1e-4 * abs(reference) + 1e-6
print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")
