# DeepSpeed ZeRO stage 1/2 with overlap_comm + contiguous_gradients (BUG version).
# Source: deepspeedai/DeepSpeed PR #5606 "Fix overlap communication of ZeRO stage 1 and 2"
#   (issue #5523, "inconsistent results with zero2 + overlap_comm"); file
#   deepspeed/runtime/zero/stage_1_and_2.py.  average_tensor() made the reduction stream wait
#   for the default stream, but the default stream never waited for the reduction stream, so
#   the backward pass could refill a ping-pong IPG buffer while the reduction stream was still
#   reading the previous bucket that lived in the same buffer.
# Structure: reduce_independent_p_g_buckets_and_remove_grads (grad hook) -> reduce_ipg_grads ->
#   average_tensor on reduction_stream; epilogue + step.  Single GPU, dp world size 1, so the
#   all-reduce of the bucket is the identity and only the pre-division remains.
import torch
import torch.nn as nn

DEV = torch.device("cuda:0")


class ZeroStage2Lite:
    def __init__(self, model, reduce_bucket_size, lr):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.dp_world_size = 1
        self.lr = lr
        self.reduce_bucket_size = reduce_bucket_size
        self.reduction_stream = torch.cuda.Stream()
        # contiguous_gradients + overlap_comm: two IPG buffers used in ping-pong fashion
        self.ipg_buffer = [torch.empty(reduce_bucket_size, device=DEV) for _ in range(2)]
        self.ipg_index = 0
        self.elements_in_ipg_bucket = 0
        self.params_in_ipg_bucket = []
        self.param_offset, off = {}, 0
        for p in self.params:
            self.param_offset[p] = off
            off += p.numel()
        # flat fp32 master partition and the averaged gradients of this rank's partition
        self.fp32_partition = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        self.averaged_gradients = torch.zeros_like(self.fp32_partition)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.reduce_independent_p_g_buckets_and_remove_grads)

    def reduce_independent_p_g_buckets_and_remove_grads(self, param):
        if self.elements_in_ipg_bucket + param.numel() > self.reduce_bucket_size:
            self.reduce_ipg_grads()
            # Swap index between 0 and 1
            self.ipg_index = 1 - self.ipg_index
        # keep gradients contiguous: copy the grad into the current IPG buffer
        new_grad_tensor = self.ipg_buffer[self.ipg_index].narrow(0, self.elements_in_ipg_bucket, param.numel())
        new_grad_tensor.copy_(param.grad.reshape(-1))
        self.params_in_ipg_bucket.append((param, self.elements_in_ipg_bucket))
        self.elements_in_ipg_bucket += param.numel()
        param.grad = None

    def reduce_ipg_grads(self):
        bucket = self.ipg_buffer[self.ipg_index].narrow(0, 0, self.elements_in_ipg_bucket)
        self.average_tensor(bucket)
        self.elements_in_ipg_bucket = 0
        self.params_in_ipg_bucket = []

    def average_tensor(self, tensor):
        stream = self.reduction_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            tensor.div_(self.dp_world_size)
            # (all-reduce / reduce-scatter of `tensor` goes here; identity for dp world size 1)
            for param, bucket_offset in self.params_in_ipg_bucket:
                n = param.numel()
                dst = self.averaged_gradients.narrow(0, self.param_offset[param], n)
                dst.copy_(tensor.narrow(0, bucket_offset, n))

    def backward(self, loss):
        loss.backward()
        # overlapping_partition_gradients_reduce_epilogue
        if self.elements_in_ipg_bucket > 0:
            self.reduce_ipg_grads()
            self.ipg_index = 1 - self.ipg_index
        torch.cuda.synchronize()

    def step(self):
        self.fp32_partition.add_(self.averaged_gradients, alpha=-self.lr)
        for p in self.params:
            off = self.param_offset[p]
            p.data.copy_(self.fp32_partition.narrow(0, off, p.numel()).view_as(p))


class MLP(nn.Module):
    def __init__(self, width=256, depth=6):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def main():
    torch.manual_seed(0)
    width = 256
    model = MLP(width).to(DEV)
    # one Linear(256, 256) (weight + bias) per bucket -> 7 buckets per backward
    engine = ZeroStage2Lite(model, reduce_bucket_size=width * width + width, lr=1e-3)
    losses = []
    for step in range(4):
        x = torch.randn(64, width, device=DEV)
        y = torch.randn(64, 1, device=DEV)
        loss = nn.functional.mse_loss(model(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    print("losses", [round(v.item(), 4) for v in losses])


if __name__ == "__main__":
    main()
