# Activation offloading to CPU with saved_tensors_hooks + a transfer stream (TRL / torchtune
# OffloadActivations, use_streams=True) (BUG version).
# Source: huggingface/trl trl/models/activation_offloading.py (from torchtune); bug reported and
#   worked around in axolotl-ai-cloud/axolotl PR #3833 and fixed upstream in huggingface/trl
#   PR #7195 ("Fix two stream races in OffloadActivations", race 2): pack_tensor cloned an
#   offset/non-contiguous saved tensor (cross-entropy's shift_labels, storage_offset=1) *inside*
#   the transfer stream context, after s1.wait_stream(s0).  The clone then belongs to s1's
#   allocator pool; backward reads it on the compute stream with no ordering edge, and when the
#   stash entry is dropped its block returns to s1, where the next H2D restore reuses it.
# Trimmed version of the real class (no dedup-by-view bookkeeping, no npu/xpu branches).
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

DEV = torch.device("cuda:0")


class OffloadActivations(saved_tensors_hooks):
    def __init__(self, min_offload_size=1024, max_fwd_stash_size=5):
        self.min_tensor_size_bytes = min_offload_size
        self.max_fwd_stash_size = max_fwd_stash_size
        self.tracker = {}        # tensor_id -> (tensor, modified, stride, storage_offset, shape)
        self.tensor_id = 0
        self.is_first_backward_call = True
        self.s0 = torch.cuda.default_stream()   # compute stream
        self.s1 = torch.cuda.Stream()           # transfer stream
        self.fwd_stash = {}      # tensor_id -> (activation, event)
        self.bwd_tensor_stash = {}
        self.bwd_ev_stash = {}
        self.curr_graph_id = None
        self.curr_autograd_node = None
        self.param_storages = set()

        def pack_tensor(activation):
            self.is_first_backward_call = True
            self.tensor_id += 1
            tensor_id = self.tensor_id
            num_bytes = activation.element_size() * activation.nelement()
            if (activation.device.type != DEV.type or num_bytes < self.min_tensor_size_bytes
                    or isinstance(activation, nn.Parameter)
                    or activation.untyped_storage().data_ptr() in self.param_storages):
                self.tracker[tensor_id] = (activation, False, None, None, None)
                return tensor_id
            for id in list(self.fwd_stash.keys()):   # sync back and drop old stash entries
                if id <= tensor_id - self.max_fwd_stash_size:
                    _, ev = self.fwd_stash[id]
                    self.s0.wait_event(ev)
                    del self.fwd_stash[id]
                else:
                    break
            self.s1.wait_stream(self.s0)
            with torch.cuda.stream(self.s1):
                # as_strided restore below needs a zero-offset contiguous tensor
                if activation.storage_offset() != 0 or not activation.is_contiguous():
                    activation = activation.clone(memory_format=torch.contiguous_format)
                cpu_tensor = torch.empty(activation.shape, dtype=activation.dtype, pin_memory=True)
                cpu_tensor.copy_(activation, non_blocking=True)
                self.tracker[tensor_id] = (cpu_tensor, True, activation.stride(),
                                           activation.storage_offset(), activation.shape)
            event = self.s1.record_event()
            self.fwd_stash[tensor_id] = (activation, event)   # keep alive until s1 is done
            return tensor_id

        def unpack_tensor(unpack_tensor_id):
            if self.is_first_backward_call:
                self.is_first_backward_call = False
                self.curr_graph_id = torch._C._current_graph_task_id()

                def wait_and_del_remaining_references():
                    for id in list(self.bwd_tensor_stash.keys()):
                        if id in self.bwd_ev_stash:
                            self.s1.wait_event(self.bwd_ev_stash.pop(id))
                        del self.bwd_tensor_stash[id]
                torch.autograd.variable.Variable._execution_engine.queue_callback(wait_and_del_remaining_references)

            maybe_gpu_tensor, modified, stride, offset, shape = self.tracker.pop(unpack_tensor_id)
            if not modified:
                return maybe_gpu_tensor
            graph_id = torch._C._current_graph_task_id()
            node = torch._C._current_autograd_node()
            prev_node_ids = []
            if graph_id == self.curr_graph_id and self.curr_autograd_node != node:
                self.curr_autograd_node = node
                prev_node_ids = list(self.bwd_tensor_stash.keys())
            brought_back_from_cpu = True
            if unpack_tensor_id in self.fwd_stash:
                maybe_gpu_tensor = self.fwd_stash[unpack_tensor_id][0]
                brought_back_from_cpu = False
            else:
                with torch.cuda.stream(self.s1):
                    gpu_tensor = maybe_gpu_tensor.to(DEV, non_blocking=True)
                    maybe_gpu_tensor = torch.as_strided(gpu_tensor, shape, stride, offset)
                self.s0.wait_stream(self.s1)   # compute waits for the H2D copy
                self.bwd_tensor_stash[unpack_tensor_id] = maybe_gpu_tensor

            def hook(outputs, inputs):
                if brought_back_from_cpu and unpack_tensor_id in self.bwd_tensor_stash:
                    self.bwd_ev_stash[unpack_tensor_id] = self.s0.record_event()
                for id in list(self.fwd_stash.keys()):   # in backward now: drop the forward stash
                    _, ev = self.fwd_stash[id]
                    self.s0.wait_event(ev)
                    del self.fwd_stash[id]
                for id in prev_node_ids:   # previous node is done with its tensors
                    if id in self.bwd_ev_stash:
                        self.s1.wait_event(self.bwd_ev_stash.pop(id))
                    self.bwd_tensor_stash.pop(id, None)
                return outputs
            node.register_hook(hook)
            return maybe_gpu_tensor

        super().__init__(pack_tensor, unpack_tensor)

    def update_model_params(self, model):
        # skip parameters and views of them (e.g. weight.t() saved by addmm)
        self.param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}


class TinyLM(nn.Module):
    def __init__(self, vocab=256, dim=256, layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
                                     for _ in range(layers)])
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for blk in self.blocks:
            h = h + blk(h)
        logits = self.lm_head(h)
        # HF-style causal LM loss: pad, shift; for batch size 1 the shifted labels are a
        # contiguous view with storage_offset 1
        labels = F.pad(labels, (0, 1), value=-100)
        shift_labels = labels[..., 1:].contiguous()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), shift_labels.view(-1), ignore_index=-100)


def main():
    torch.manual_seed(0)
    model = TinyLM().to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    offload_ctx = OffloadActivations()
    offload_ctx.update_model_params(model)
    losses = []
    for step in range(4):
        input_ids = torch.randint(0, 256, (1, 512), device=DEV)
        with offload_ctx:
            loss = model(input_ids, labels=input_ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    print("losses", [round(v.item(), 4) for v in losses])


if __name__ == "__main__":
    main()
