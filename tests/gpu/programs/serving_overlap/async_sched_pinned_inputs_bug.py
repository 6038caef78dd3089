# Source: vLLM v1 async scheduling, vllm/v1/worker/gpu_model_runner.py,
# GPUModelRunner.execute_model():
#     if self.prepare_inputs_event is not None:
#         # Ensure prior step has finished with reused CPU tensors.
#         self.prepare_inputs_event.synchronize()
#     try: ... self._prepare_inputs(scheduler_output) ...
#     finally: self.prepare_inputs_event.record()
# The runner keeps persistent pinned CPU buffers (input_ids_cpu, positions_cpu,
# the CpuGpuBuffer pairs) that are refilled on the host every step and copied
# into persistent GPU buffers with non_blocking=True.
#
# Race (host-device, write-after-read): with async scheduling the host never
# waits for the GPU between steps, so _prepare_inputs() for step N+1 overwrites
# the pinned buffers (input_ids_cpu[:n].copy_(...), positions_cpu[:n].copy_(...))
# while the H2D copies of step N, queued behind step N-1's forward, may not have
# read them yet -> step N runs on step N+1's tokens and positions.
# Fix: synchronize on prepare_inputs_event (recorded right after the previous
# step's H2D copies were enqueued) before writing the pinned buffers again.
import torch
import torch.nn as nn

DEV = "cuda:0"
V, H, CHUNK, STEPS = 8192, 512, 1024, 16
MAX_POS = CHUNK * STEPS
SLEEP_CYCLES = 2_000_000  # ~1 ms GPU busy-wait: each forward is long under load


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.pos_embed = nn.Embedding(MAX_POS, H)
        self.mlp = nn.Sequential(nn.Linear(H, H), nn.GELU(), nn.Linear(H, H))
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, ids, positions):
        return self.lm_head(self.mlp(self.embed(ids) + self.pos_embed(positions)))


class GPUModelRunner:
    def __init__(self):
        self.model = TinyLM().to(DEV).eval()
        # persistent, reused every step
        self.input_ids_cpu = torch.zeros(CHUNK, dtype=torch.long).pin_memory()
        self.positions_cpu = torch.zeros(CHUNK, dtype=torch.long).pin_memory()
        self.input_ids = torch.zeros(CHUNK, dtype=torch.long, device=DEV)
        self.positions = torch.zeros(CHUNK, dtype=torch.long, device=DEV)
        self.weights = torch.arange(1, CHUNK + 1, device=DEV)
        self.acc = torch.zeros((), dtype=torch.long, device=DEV)
        # CUDA event to synchronize use of reused CPU tensors between steps
        self.prepare_inputs_event = torch.cuda.Event()
        # Start in a completed state.
        self.prepare_inputs_event.record(torch.cuda.default_stream())

    def _prepare_inputs(self, token_ids, positions):
        n = token_ids.numel()
        # host writes into the reused pinned buffers
        self.input_ids_cpu[:n].copy_(token_ids)
        self.positions_cpu[:n].copy_(positions)
        # async H2D into the persistent device buffers
        self.input_ids[:n].copy_(self.input_ids_cpu[:n], non_blocking=True)
        self.positions[:n].copy_(self.positions_cpu[:n], non_blocking=True)
        return n

    @torch.inference_mode()
    def execute_model(self, token_ids, positions):
        # BUG: missing self.prepare_inputs_event.synchronize(): the previous
        # step's H2D copies may still be reading the pinned buffers.
        try:
            n = self._prepare_inputs(token_ids, positions)
        finally:
            self.prepare_inputs_event.record()
        torch.cuda._sleep(SLEEP_CYCLES)  # the forward pass is long
        logits = self.model(self.input_ids[:n], self.positions[:n])
        self.acc += (logits.argmax(dim=-1) * self.weights[:n]).sum()


def main():
    torch.manual_seed(0)
    runner = GPUModelRunner()
    prompt = torch.randint(0, V, (MAX_POS,))  # one long prompt, chunked prefill
    for step in range(STEPS):
        lo, hi = step * CHUNK, (step + 1) * CHUNK
        runner.execute_model(prompt[lo:hi], torch.arange(lo, hi))
    torch.cuda.synchronize()
    print(f"async_sched_pinned_inputs checksum: {runner.acc.item()}")


if __name__ == "__main__":
    main()
