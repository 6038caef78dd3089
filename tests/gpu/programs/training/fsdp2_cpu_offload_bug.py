# PyTorch FSDP2 (fully_shard) with CPUOffloadPolicy(pin_memory=True), emulated (BUG version).
# Source: pytorch/pytorch torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py::foreach_reduce
#   copies each reduced gradient shard D2H with non_blocking=True on the reduce-scatter stream and
#   sets fsdp_param.grad_offload_event = reduce_scatter_stream.record_event(); FSDPParamGroup.
#   finalize_backward() (root post-backward callback) calls grad_offload_event.synchronize() so the
#   CPU optimizer does not read/modify pinned memory that the GPU streams still use (see the FSDP2
#   test "test_cpu_offload_grad_copy_synchronized").  This version drops that synchronize().
# Emulation: world size 1, so all-gather / reduce-scatter are copies on the FSDP2 streams; the
# copy-in stream H2D-copies the pinned CPU shards; buffers are freed FSDP2-style (event waits
# instead of record_stream).
import torch
import torch.nn as nn
from torch.autograd import Variable

DEV = torch.device("cuda:0")


class FSDPParam:
    def __init__(self, module, name):
        param = getattr(module, name)
        self.sharded_param = nn.Parameter(param.detach().cpu().pin_memory())   # CPU offload
        self.unsharded_param = nn.Parameter(torch.empty_like(param))          # GPU
        self.grad_offload_event = None
        delattr(module, name)
        module.register_parameter(name, self.unsharded_param)


class CommContext:
    def __init__(self):
        self.all_gather_copy_in_stream = torch.cuda.Stream(priority=-1)
        self.all_gather_stream = torch.cuda.Stream(priority=-1)
        self.reduce_scatter_stream = torch.cuda.Stream(priority=-1)
        self.reduce_scatter_state = None   # (reduce_scatter_input, event)


class FSDPParamGroup:
    def __init__(self, module, comm_ctx):
        self.fsdp_params = [FSDPParam(module, n) for n in ("weight", "bias")]
        self.numels = [fp.sharded_param.numel() for fp in self.fsdp_params]
        self.comm_ctx = comm_ctx
        self._all_gather_result = None
        self._post_reduce_event = None
        self._grads_ready = 0
        for fp in self.fsdp_params:
            fp.unsharded_param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def unshard(self):
        if self._all_gather_result is not None:
            return
        ctx = self.comm_ctx
        with torch.cuda.stream(ctx.all_gather_copy_in_stream):
            all_gather_input = torch.empty(sum(self.numels), device=DEV)
            for dst, fp in zip(all_gather_input.split(self.numels), self.fsdp_params):
                dst.copy_(fp.sharded_param.detach().reshape(-1), non_blocking=True)
        ctx.all_gather_stream.wait_stream(ctx.all_gather_copy_in_stream)
        with torch.cuda.stream(ctx.all_gather_stream):
            all_gather_output = torch.empty_like(all_gather_input)
            all_gather_output.copy_(all_gather_input)          # all_gather_into_tensor, world size 1
            event = ctx.all_gather_stream.record_event()
        self._all_gather_result = (all_gather_input, all_gather_output, event)

    def wait_for_unshard(self):
        _, all_gather_output, event = self._all_gather_result
        cur = torch.cuda.current_stream()
        cur.wait_event(event)
        for src, fp in zip(all_gather_output.split(self.numels), self.fsdp_params):
            fp.unsharded_param.data.copy_(src.view_as(fp.unsharded_param))   # copy-out
        copy_out_event = cur.record_event()
        # free the all-gather buffers without record_stream: make both streams wait first
        self.comm_ctx.all_gather_copy_in_stream.wait_event(copy_out_event)
        self.comm_ctx.all_gather_stream.wait_event(copy_out_event)
        self._all_gather_result = None

    def _on_grad_ready(self, param):
        self._grads_ready += 1
        if self._grads_ready == len(self.fsdp_params):
            self._grads_ready = 0
            self.post_backward()

    def post_backward(self):
        ctx, cur = self.comm_ctx, torch.cuda.current_stream()
        reduce_scatter_input = torch.empty(sum(self.numels), device=DEV)
        for dst, fp in zip(reduce_scatter_input.split(self.numels), self.fsdp_params):
            dst.copy_(fp.unsharded_param.grad.reshape(-1))
            fp.unsharded_param.grad = None
        if ctx.reduce_scatter_state is not None:   # previous RS input may be freed once its RS is done
            cur.wait_event(ctx.reduce_scatter_state[1])
            ctx.reduce_scatter_state = None
        ctx.reduce_scatter_stream.wait_stream(cur)
        with torch.cuda.stream(ctx.reduce_scatter_stream):
            reduce_output = torch.empty_like(reduce_scatter_input)
            reduce_output.copy_(reduce_scatter_input)           # reduce_scatter_tensor, world size 1
            for src, fp in zip(reduce_output.split(self.numels), self.fsdp_params):
                fp.sharded_param.grad = src.view_as(fp.sharded_param).to("cpu", non_blocking=True)
                fp.grad_offload_event = ctx.reduce_scatter_stream.record_event()
            self._post_reduce_event = ctx.reduce_scatter_stream.record_event()
        ctx.reduce_scatter_state = (reduce_scatter_input, self._post_reduce_event)

    def finalize_backward(self):
        if self._post_reduce_event is not None:
            torch.cuda.current_stream().wait_event(self._post_reduce_event)
            self._post_reduce_event = None
        for fp in self.fsdp_params:
            if fp.grad_offload_event is not None:
                fp.grad_offload_event = None


class FSDPModel(nn.Module):
    def __init__(self, d=256, n=4):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(n)]).to(DEV)
        self.comm_ctx = CommContext()
        self.groups = [FSDPParamGroup(b[0], self.comm_ctx) for b in self.blocks]   # fully_shard(block)
        for i, b in enumerate(self.blocks):
            b.register_forward_pre_hook(self._make_pre_forward(i))

    def _make_pre_forward(self, i):
        def hook(module, args):
            self.groups[i].unshard()
            self.groups[i].wait_for_unshard()
            if i + 1 < len(self.groups):
                self.groups[i + 1].unshard()   # explicit forward prefetch
        return hook

    def _root_post_backward_final_callback(self):
        for group in self.groups:
            group.finalize_backward()
        if self.comm_ctx.reduce_scatter_state is not None:
            torch.cuda.current_stream().wait_event(self.comm_ctx.reduce_scatter_state[1])
            self.comm_ctx.reduce_scatter_state = None

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        x.register_hook(self._root_pre_backward)
        return x

    def _root_pre_backward(self, grad):
        Variable._execution_engine.queue_callback(self._root_post_backward_final_callback)
        return grad


def main():
    torch.manual_seed(0)
    model = FSDPModel()
    sharded = [fp.sharded_param for g in model.groups for fp in g.fsdp_params]
    optim = torch.optim.Adam(sharded, lr=1e-3)    # CPU optimizer over the pinned shards
    losses = []
    for step in range(5):
        x = torch.randn(64, 256, device=DEV)
        y = torch.randn(64, 256, device=DEV)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    print("losses", [round(v.item(), 5) for v in losses])


if __name__ == "__main__":
    main()
