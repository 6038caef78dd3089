# Source: NVIDIA/TransformerEngine transformer_engine/pytorch/cpu_offload.py,
#         AsyncDoubleBufferGroupOffloadHandler.synchronize_on_group_commit_forward() / bulk_offload_group() /
#         bulk_reload_group() (the d2h_final_event wait for the last offloaded group).
# Bug: activations of each layer group are offloaded on d2h_stream into pinned CPU buffers. For every group
#      but the last, the next group's commit makes the compute stream wait for d2h_stream, so the later
#      reload (h2d_stream waits for the compute stream) is ordered after the D2H copy. The last group is
#      reloaded first in backward, and bulk_reload_group() skips `h2d_stream.wait_event(d2h_final_event)`:
#      the H2D copy on h2d_stream reads the pinned buffer that the D2H copy on d2h_stream may still be
#      writing (two streams, pinned host memory).
# Fix: bulk_reload_group() makes h2d_stream wait on d2h_final_event (recorded after the last group's
#      offload) before reloading the last group, as TransformerEngine does.
import torch

SLEEP_CYCLES = 30_000_000  # ~15 ms: PCIe contention delays the last offload


class AsyncDoubleBufferGroupOffloadHandler:
    def __init__(self, num_offload_group):
        self.num_offload_group = num_offload_group
        self.d2h_stream = torch.cuda.Stream()
        self.h2d_stream = torch.cuda.Stream()
        self.d2h_final_event = torch.cuda.Event()
        self.tensor_tag_to_state = {}
        self.tensor_tag_to_buf = {}

    def tensor_push(self, tensor, group_id):
        tag = (group_id, len(self.tensor_tag_to_state))
        self.tensor_tag_to_state[tag] = tensor
        return tag

    @staticmethod
    def offload(src_tensor):
        cpu_backup = torch.empty(src_tensor.size(), dtype=src_tensor.dtype, device="cpu", pin_memory=True)
        cpu_backup.copy_(src_tensor, non_blocking=True)
        return (src_tensor.device, cpu_backup)

    def bulk_offload_group(self, group_to_offload):
        with torch.cuda.stream(self.d2h_stream):
            if group_to_offload == self.num_offload_group - 1:
                torch.cuda._sleep(SLEEP_CYCLES)
            for tag, state in self.tensor_tag_to_state.items():
                if tag[0] == group_to_offload:
                    self.tensor_tag_to_state[tag] = self.offload(state)
                    state.record_stream(self.d2h_stream)

    def synchronize_on_group_commit_forward(self, current_group):
        # Stream synchronization both ways: offload after compute produced the tensors, and
        # compute after the previous group's offload finished.
        self.d2h_stream.wait_stream(torch.cuda.current_stream())
        torch.cuda.current_stream().wait_stream(self.d2h_stream)
        self.bulk_offload_group(current_group)
        if current_group == self.num_offload_group - 1:
            self.d2h_stream.record_event(self.d2h_final_event)

    def bulk_reload_group(self, group_to_reload):
        # (missing) if group_to_reload == self.num_offload_group - 1:
        # (missing)     self.h2d_stream.wait_event(self.d2h_final_event)
        self.h2d_stream.wait_stream(torch.cuda.current_stream())
        for tag, state in self.tensor_tag_to_state.items():
            if tag[0] == group_to_reload and isinstance(state, tuple):
                dev, cpu_backup = state
                # allocate on the current stream so later compute can reuse the memory
                self.tensor_tag_to_buf[tag] = torch.empty(cpu_backup.size(), dtype=cpu_backup.dtype, device=dev)
        with torch.cuda.stream(self.h2d_stream):
            for tag, state in self.tensor_tag_to_state.items():
                if tag[0] == group_to_reload and isinstance(state, tuple):
                    self.tensor_tag_to_buf[tag].copy_(state[1], non_blocking=True)
                    self.tensor_tag_to_state[tag] = None

    def tensor_pop(self, tag):
        torch.cuda.current_stream().wait_stream(self.h2d_stream)
        return self.tensor_tag_to_buf.pop(tag)


def main():
    torch.manual_seed(0)
    num_layers, tokens, hidden = 6, 2048, 1024
    weights = [torch.randn(hidden, hidden, device="cuda") / hidden**0.5 for _ in range(num_layers)]
    x = torch.randn(tokens, hidden, device="cuda")
    grad_out = torch.randn(tokens, hidden, device="cuda")
    handler = AsyncDoubleBufferGroupOffloadHandler(num_layers)
    torch.cuda.synchronize()

    # Forward: each layer is one offload group; its input activation is saved for the wgrad GEMM.
    tags, ref_acts, h = [], [], x
    for g in range(num_layers):
        ref_acts.append(h.clone())  # reference copy, stays on the GPU
        tags.append(handler.tensor_push(h, g))
        h = torch.tanh(h @ weights[g])
        handler.synchronize_on_group_commit_forward(g)

    # Backward: reload groups in reverse order and compute weight gradients.
    wgrads = [None] * num_layers
    for g in reversed(range(num_layers)):
        handler.bulk_reload_group(g)
        act = handler.tensor_pop(tags[g])
        wgrads[g] = act.t() @ grad_out
    torch.cuda.synchronize()

    ref = [a.t() @ grad_out for a in ref_acts]
    match = all(torch.allclose(w, r, rtol=1e-3, atol=1e-2) for w, r in zip(wgrads, ref))
    print(f"match={match}")


if __name__ == "__main__":
    main()
