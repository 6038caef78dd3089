# Source: DeepSpeed ZeRO stage 1/2, deepspeed/runtime/zero/stage_1_and_2.py: DeepSpeedZeroOptimizer.reduce_ipg_grads()
#   with overlap_comm=True, contiguous_gradients=False: the bucket is reduced inside
#   `with get_accelerator().stream(self.reduction_stream):` (allreduce_bucket: flatten, all_reduce, copy back), and
#   grads of parameters outside this rank's partition are not cleared there but appended to
#   self.previous_reduced_grads ("Clear grads of other partitions during the next reduction to avoid clearing them
#   before the reduction is complete"); allreduce_and_copy() later calls get_accelerator().synchronize() and then
#   _clear_previous_reduced_grads(). One rank here: the all-reduce is the local average flat.div_(dp_world_size).
# Bug: reduce_ipg_grads() clears `param.grad = None` for the other partitions' params right away, inside the
#   reduction-stream block, as if a free there were ordered on that stream. The grads were allocated by backward on
#   the default stream, so their blocks go straight back to the default stream's pool; the next backward gradients
#   (default stream) get them and are written while the reduction stream's flatten/copy-back of the cleared grads is
#   still pending. The reduction stream's read/write of the old grads and backward's write of the new ones are
#   unordered, so later buckets (this rank's partition) are reduced from corrupted gradients.
# Fix: DeepSpeed's deferral: keep the reduced grads in previous_reduced_grads and clear them only at the next
#   reduction (and at the end of backward) after torch.cuda.synchronize().
import torch
import torch.nn as nn

NUM_LAYERS, DIM, TOKENS = 8, 2048, 512     # 16 MiB fp32 gradients: one exact-size segment each
DP_WORLD_SIZE = 2
REDUCE_DELAY = 20_000_000        # cycles: all-reduce latency stand-in on the reduction stream


class ZeroStage2Reducer:
    def __init__(self, params, reduce_bucket_params=2):
        self.reduction_stream = torch.cuda.Stream()
        self.reduce_bucket_params = reduce_bucket_params
        self.params_in_ipg_bucket = []
        self.previous_reduced_grads = None
        # rank 0 owns the first half of the flattened parameter group
        self.is_param_in_current_partition = {id(p): i < len(params) // DP_WORLD_SIZE for i, p in enumerate(params)}

    def reduce_independent_p_g_buckets_and_remove_grads(self, param):
        if len(self.params_in_ipg_bucket) == self.reduce_bucket_params:
            self.reduce_ipg_grads()
        self.params_in_ipg_bucket.append(param)

    def _clear_previous_reduced_grads(self):
        if self.previous_reduced_grads is not None:
            for p in self.previous_reduced_grads:
                p.grad = None
            self.previous_reduced_grads = None

    def reduce_ipg_grads(self):
        # allreduce_and_copy(): after a synchronize it is safe to clear the previously reduced grads
        torch.cuda.synchronize()
        self._clear_previous_reduced_grads()
        params = self.params_in_ipg_bucket
        stream = self.reduction_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda._sleep(REDUCE_DELAY)
            flat = torch.cat([p.grad.reshape(-1) for p in params])          # allreduce_bucket: flatten
            flat.div_(DP_WORLD_SIZE)                                         # all_reduce + average (one rank)
            for p, synced in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(synced.view_as(p.grad))                         # copy back
            for p in params:
                if not self.is_param_in_current_partition[id(p)]:
                    # clear during the next reduction, not before this one is complete
                    if self.previous_reduced_grads is None:
                        self.previous_reduced_grads = []
                    self.previous_reduced_grads.append(p)
        self.params_in_ipg_bucket = []

    def finish_backward(self):
        if self.params_in_ipg_bucket:
            self.reduce_ipg_grads()
        torch.cuda.current_stream().wait_stream(self.reduction_stream)
        torch.cuda.synchronize()
        self._clear_previous_reduced_grads()


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    weights = [nn.Parameter(torch.empty(DIM, DIM, device=dev).normal_(std=0.02)) for _ in range(NUM_LAYERS)]
    acts = [torch.randn(TOKENS, DIM, device=dev) for _ in range(NUM_LAYERS)]     # saved forward inputs
    grad_outs = [torch.randn(TOKENS, DIM, device=dev) for _ in range(NUM_LAYERS)]
    reducer = ZeroStage2Reducer(weights)
    torch.cuda.synchronize()

    for i in reversed(range(NUM_LAYERS)):                   # backward, last layer first (default stream)
        weights[i].grad = grad_outs[i].t() @ acts[i]
        reducer.reduce_independent_p_g_buckets_and_remove_grads(weights[i])
    reducer.finish_backward()
    owned = [w.grad.clone() for w in weights if reducer.is_param_in_current_partition[id(w)]]
    torch.cuda.synchronize()

    expected = [(grad_outs[i].t() @ acts[i]) / DP_WORLD_SIZE
                for i, w in enumerate(weights) if reducer.is_param_in_current_partition[id(w)]]
    ok = all(torch.allclose(g, e, rtol=1e-4, atol=1e-5) for g, e in zip(owned, expected))
    print(f"match={ok}")


if __name__ == "__main__":
    main()
