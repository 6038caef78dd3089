# Source: vllm-ascend PR #4501 "[Performance] Add async exponential while model
# executing" (model_runner_v1._do_async_exponential: the exponential noise `q`
# for random sampling is generated on a side stream, overlapping the forward)
# and the fix PRs #13402/#13403 "[BugFix][Sampler] Fix inf in Qwen30b RL
# sampling by recording stream for q": "tensor q is allocated on
# global_stream() but consumed on current_stream() via probs.div_(q). The code
# only establishes an execution dependency (wait_stream), but does not declare
# the storage lifetime of q on the consumer stream."  Ported from torch.npu to
# torch.cuda; FIXED as in the PR with q.record_stream(current_stream()).
import torch

DEV = torch.device("cuda:0")
NUM_REQS, HIDDEN, VOCAB, NUM_STEPS = 64, 1024, 32000, 8


class SamplingMetadata:
    def __init__(self):
        self.temperature = torch.full((NUM_REQS, 1), 0.8, device=DEV)
        # Requests 3 and 17 carry their own seed (per-request generators).
        self.generators = {i: torch.Generator(device=DEV).manual_seed(1000 + i) for i in (3, 17)}


class Sampler:
    def __init__(self, exponential_stream):
        self.exponential_stream = exponential_stream
        self.q = None

    def set_q(self, q):
        self.q = q

    def random_sample(self, probs, generators):
        q, self.q = self.q, None
        torch.cuda.current_stream().wait_stream(self.exponential_stream)
        q.record_stream(torch.cuda.current_stream())  # FIX
        return probs.div_(q).argmax(dim=-1).view(-1)

    def forward(self, logits, md: SamplingMetadata):
        logits = logits.float().div_(md.temperature)
        probs = logits.softmax(dim=-1)
        return self.random_sample(probs, md.generators)


class NPUModelRunner:  # name kept from vllm-ascend; runs on CUDA here
    def __init__(self):
        g = torch.Generator(device=DEV).manual_seed(0)
        self.embed = torch.randn(VOCAB, HIDDEN, device=DEV, generator=g) * 0.05
        self.w1 = torch.randn(HIDDEN, 4 * HIDDEN, device=DEV, generator=g) * 0.02
        self.w2 = torch.randn(4 * HIDDEN, HIDDEN, device=DEV, generator=g) * 0.02
        self.lm_head = torch.randn(HIDDEN, VOCAB, device=DEV, generator=g) * 0.05
        self._async_exponential_stream = torch.cuda.Stream()
        self.sampler = Sampler(self._async_exponential_stream)
        self.sampling_metadata = SamplingMetadata()

    def _do_async_exponential(self, default_stream, num_reqs):
        # Calculating exponential randoms in a different stream
        # and overlapping with model executing.
        with torch.cuda.stream(self._async_exponential_stream):
            self._async_exponential_stream.wait_stream(default_stream)
            q = torch.empty((num_reqs, VOCAB), device=DEV, dtype=torch.float32)
            generators = self.sampling_metadata.generators
            if len(generators) != q.shape[0]:
                q.exponential_()
            if generators:
                for i, generator in generators.items():
                    q[i].exponential_(generator=generator)
        self.sampler.set_q(q)

    def _model_forward(self, input_ids):
        h = self.embed[input_ids]
        for _ in range(4):
            h = h + torch.relu(h @ self.w1) @ self.w2
        return h @ self.lm_head

    def execute_model(self, input_ids):
        default_stream = torch.cuda.current_stream()
        self._do_async_exponential(default_stream, input_ids.shape[0])
        logits = self._model_forward(input_ids)
        return self.sampler.forward(logits, self.sampling_metadata)


def main():
    torch.manual_seed(0)
    runner = NPUModelRunner()
    input_ids = torch.arange(NUM_REQS, device=DEV) * 37 % VOCAB
    torch.cuda.synchronize()
    history = []
    for _ in range(NUM_STEPS):
        input_ids = runner.execute_model(input_ids)
        history.append(input_ids)
    torch.cuda.synchronize()
    print("sampled:", torch.stack(history).shape, history[-1][:4].tolist())


if __name__ == "__main__":
    main()
