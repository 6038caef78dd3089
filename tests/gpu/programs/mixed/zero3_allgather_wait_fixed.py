# Source: microsoft/DeepSpeed deepspeed/runtime/zero/partitioned_param_coordinator.py,
#         PartitionedParameterCoordinator.fetch_sub_module() / __all_gather_params() / release_sub_module(),
#         and free_param() in deepspeed/runtime/zero/partition_parameters.py.
# Bug: ZeRO-3 materialises each sub-module's full parameter on the coordinator's __allgather_stream
#      (all_gather_coalesced; with one rank it is a copy of the partition into a fresh buffer). The module's
#      forward runs on the default stream right after fetch_sub_module() returns, but fetch_sub_module() never
#      does get_accelerator().current_stream().wait_stream(self.__allgather_stream): the default stream's
#      matmul reads param.data while the all-gather stream may still be writing it.
# Fix: fetch_sub_module() ends with torch.cuda.current_stream().wait_stream(self.__allgather_stream), as DeepSpeed does.
import torch
import torch.nn as nn

SLEEP_CYCLES = 25_000_000  # ~12 ms: all-gather latency on the communication stream

NOT_AVAILABLE, INFLIGHT, AVAILABLE = "NOT_AVAILABLE", "INFLIGHT", "AVAILABLE"


def partition_param(param):
    """zero.Init: keep only the (single-rank) partition in ds_tensor, drop the full tensor."""
    param.ds_shape = param.data.shape
    param.ds_numel = param.data.numel()
    param.ds_tensor = param.data.detach().flatten().clone()
    param.ds_status = NOT_AVAILABLE
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def free_param(param):
    # need to make sure that we don't free the parameter while it is still being used for computation
    param.data.record_stream(torch.cuda.current_stream())
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    param.ds_status = NOT_AVAILABLE


class PartitionedParameterCoordinator:
    def __init__(self):
        self.__allgather_stream = torch.cuda.Stream()

    def __all_gather_params(self, params):
        with torch.cuda.stream(self.__allgather_stream):
            for param in params:
                param.ds_status = INFLIGHT
                torch.cuda._sleep(SLEEP_CYCLES)  # NCCL all-gather in flight
                flat = torch.empty(param.ds_numel, dtype=param.dtype, device="cuda")
                flat.copy_(param.ds_tensor)  # world_size == 1: the gathered tensor is the partition
                param.data = flat.view(param.ds_shape)
                param.ds_status = AVAILABLE

    @torch.no_grad()
    def fetch_sub_module(self, submodule):
        params = [p for p in submodule.parameters(recurse=False) if p.ds_status == NOT_AVAILABLE]
        self.__all_gather_params(params)
        torch.cuda.current_stream().wait_stream(self.__allgather_stream)

    @torch.no_grad()
    def release_sub_module(self, submodule):
        for p in submodule.parameters(recurse=False):
            free_param(p)


class MLPStack(nn.Module):
    def __init__(self, hidden=1024, layers=6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


def register_zero3_hooks(model, coordinator):
    for m in model.layers:
        m.register_forward_pre_hook(lambda mod, inp: coordinator.fetch_sub_module(mod))
        m.register_forward_hook(lambda mod, inp, out: coordinator.release_sub_module(mod))


def main():
    torch.manual_seed(0)
    model = MLPStack().cuda().eval()
    dense = MLPStack().cuda().eval()
    dense.load_state_dict(model.state_dict())  # reference copy, never partitioned
    for p in model.parameters():
        partition_param(p)
    coordinator = PartitionedParameterCoordinator()
    register_zero3_hooks(model, coordinator)
    x = torch.randn(64, 1024, device="cuda")
    torch.cuda.synchronize()

    outs = []
    with torch.no_grad():
        for step in range(3):  # ZeRO-Inference generate steps
            outs.append(model(x + step))
    torch.cuda.synchronize()

    with torch.no_grad():
        ref = [dense(x + step) for step in range(3)]
    match = all(torch.allclose(o, r, rtol=1e-4, atol=1e-5) for o, r in zip(outs, ref))
    print(f"match={match}")


if __name__ == "__main__":
    main()
