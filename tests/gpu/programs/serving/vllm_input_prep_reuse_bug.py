# Source: vLLM v1 vllm/v1/worker/gpu_model_runner.py: persistent CpuGpuBuffer
# staging tensors (pinned .cpu/.np + .gpu, copy_to_gpu() = non_blocking H2D)
# and GPUModelRunner.synchronize_input_prep(), whose comment reads "Ensure prior
# step has finished with reused CPU tensors. This is required in the async
# scheduling case because the CPU->GPU transfer happens async."  The same
# corruption was reported for the Ascend runner in vllm-ascend PR #16428 ("CPU
# preparation of the next batch overwrote those arrays before the preceding
# batch's transfer consumed them").  This version has no such guard: with async
# scheduling the host writes positions for step i+1 into the pinned buffer
# while the H2D copy of step i may still be reading it.
import numpy as np
import torch

DEV = torch.device("cuda:0")
MAX_REQS, HIDDEN, VOCAB, MAX_POS, NUM_STEPS = 128, 1024, 8192, 4096, 10


class CpuGpuBuffer:
    def __init__(self, size, dtype):
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=True)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(size, dtype=dtype, device=DEV)

    def copy_to_gpu(self, n):
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class SchedulerOutput:
    def __init__(self, step, req_ids, finished, new_reqs):
        self.step, self.req_ids = step, req_ids
        self.finished_req_ids, self.new_reqs = finished, new_reqs  # new: id -> prompt len


class GPUModelRunner:
    def __init__(self):
        g = torch.Generator(device=DEV).manual_seed(0)
        self.embed = torch.randn(VOCAB, HIDDEN, device=DEV, generator=g) * 0.05
        self.pos_embed = torch.randn(MAX_POS, HIDDEN, device=DEV, generator=g) * 0.05
        self.lm_head = torch.randn(HIDDEN, VOCAB, device=DEV, generator=g) * 0.05
        self.positions = CpuGpuBuffer(MAX_REQS, torch.int64)
        self.num_computed_tokens_cpu = np.zeros(MAX_REQS, dtype=np.int64)
        self.req_id_to_index = {}
        # Async scheduling: decode input ids come from the previous sampled ids.
        self.prev_sampled = torch.randint(0, VOCAB, (MAX_REQS,), device=DEV, generator=g)
        self.sampled = []

    def _update_states(self, so):
        for rid in so.finished_req_ids:
            self.req_id_to_index.pop(rid)
        for rid, prompt_len in so.new_reqs.items():
            idx = min(set(range(MAX_REQS)) - set(self.req_id_to_index.values()))
            self.req_id_to_index[rid] = idx
            self.num_computed_tokens_cpu[idx] = prompt_len

    def _prepare_inputs(self, so):
        n = len(so.req_ids)  # persistent batch is kept condensed: row == index
        self.positions.np[:n] = self.num_computed_tokens_cpu[:n]
        self.num_computed_tokens_cpu[:n] += 1
        return n, self.positions.copy_to_gpu(n)

    def execute_model(self, so):
        self._update_states(so)
        n, positions = self._prepare_inputs(so)
        input_ids = self.prev_sampled[:n]
        h = self.embed[input_ids] + self.pos_embed[positions]
        logits = torch.tanh(h) @ self.lm_head
        sampled = logits.argmax(dim=-1)
        self.prev_sampled[:n].copy_(sampled)
        self.sampled.append(sampled)  # handed to the async output thread


def make_schedule():
    reqs, outs, nxt = [f"r{i}" for i in range(96)], [], 96
    for step in range(NUM_STEPS):
        new = {r: 100 + 7 * i for i, r in enumerate(reqs)} if step == 0 else {}
        finished = []
        if step > 0 and step % 3 == 0:  # one request finishes, one arrives
            finished = [reqs.pop(0)]
            reqs.append(f"r{nxt}")
            new = {f"r{nxt}": 50}
            nxt += 1
        outs.append(SchedulerOutput(step, list(reqs), finished, new))
    return outs


def main():
    runner = GPUModelRunner()
    torch.cuda.synchronize()
    for so in make_schedule():
        runner.execute_model(so)  # no host sync between steps (async scheduling)
    torch.cuda.synchronize()
    print("sampled:", torch.stack(runner.sampled).shape, runner.num_computed_tokens_cpu[:4])


if __name__ == "__main__":
    main()
