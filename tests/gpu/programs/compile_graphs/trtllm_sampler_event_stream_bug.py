# Source: TensorRT-LLM tensorrt_llm/_torch/pyexecutor/sampler.py, TorchSampler.sample_async() /
#         update_requests() (new_tokens_host = new_tokens.to("cpu", non_blocking=True);
#         sampler_event = torch.cuda.Event(); sampler_event.record(); ... state.sampler_event.synchronize()
#         before state.host.new_tokens.tolist()), driven by PyExecutor whose forward step runs on
#         self.execution_stream and replays the model engine's CUDA graph there.
# Bug: the executor issues forward + sampling + the D2H copy inside `with torch.cuda.stream(execution_stream)`,
#      but records sampler_event after leaving that block, i.e. on the default stream, which has nothing queued.
#      update_requests() synchronizes on that event, returns at once, and .tolist() reads the pinned
#      new_tokens_host while the execution stream's non_blocking D2H copy into it is still pending: host read
#      vs execution-stream write of the pinned new_tokens_host buffer. Stale tokens are fed back as inputs.
# Fix: record the event on the stream that did the copy: sampler_event.record(self.execution_stream).
from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda:0")
SLEEP_CYCLES = 30_000_000  # ~15 ms on an H200
VOCAB, HIDDEN, MAX_BATCH, STEPS = 1024, 256, 8, 6


class VocabParallelEmbedding(torch.nn.Embedding):
    """tp_size=1 VocabParallelEmbedding: ids outside this shard's vocab range are masked to a zero row."""

    def forward(self, input_):
        input_mask = (input_ < 0) | (input_ >= self.num_embeddings)
        out = super().forward(input_.masked_fill(input_mask, 0))
        return out.masked_fill(input_mask.unsqueeze(-1), 0.0)


class TinyDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = VocabParallelEmbedding(VOCAB, HIDDEN)
        self.mlp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        return self.lm_head(h + torch.tanh(self.mlp(h)))


class PyTorchModelEngine:
    """Decode step captured once; inputs go through static buffers (CUDA graph runner)."""

    def __init__(self, model):
        self.model = model
        self.input_ids_cuda = torch.zeros(MAX_BATCH, dtype=torch.int64, device=DEVICE)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model(self.input_ids_cuda)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model(self.input_ids_cuda)

    def forward(self, tokens):
        self.input_ids_cuda.copy_(torch.tensor(tokens, dtype=torch.int64).pin_memory(), non_blocking=True)
        torch.cuda._sleep(SLEEP_CYCLES)  # stand-in for the decoder layers of a real model
        self.graph.replay()
        return self.logits


@dataclass
class SampleState:
    new_tokens_device: torch.Tensor
    new_tokens_host: torch.Tensor
    sampler_event: torch.cuda.Event


class TorchSampler:
    def __init__(self):
        self.new_tokens = torch.zeros(MAX_BATCH, dtype=torch.int64, device=DEVICE)  # self.store.new_tokens

    def sample_async(self, logits):
        torch.argmax(logits, dim=-1, out=self.new_tokens)
        return self.new_tokens.to(device="cpu", non_blocking=True)

    def update_requests(self, state, requests):
        state.sampler_event.synchronize()
        new_tokens = state.new_tokens_host.tolist()
        for req, tok in zip(requests, new_tokens):
            req.append(tok)


class PyExecutor:
    def __init__(self, model_engine, sampler):
        self.model_engine, self.sampler = model_engine, sampler
        self.execution_stream = torch.cuda.Stream()

    def _forward_step_and_sample(self, requests):
        with torch.cuda.stream(self.execution_stream):
            logits = self.model_engine.forward([req[-1] for req in requests])
            new_tokens_host = self.sampler.sample_async(logits)
        sampler_event = torch.cuda.Event()
        sampler_event.record()  # BUG: records on the default stream, not on execution_stream
        return SampleState(self.sampler.new_tokens, new_tokens_host, sampler_event)

    def executor_loop(self, requests, steps):
        for _ in range(steps):
            state = self._forward_step_and_sample(requests)
            self.sampler.update_requests(state, requests)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = TinyDecoder().to(DEVICE).eval()
    engine = PyTorchModelEngine(model)
    executor = PyExecutor(engine, TorchSampler())
    torch.cuda.synchronize()

    prompts = torch.randint(0, VOCAB, (MAX_BATCH,)).tolist()
    requests = [[p] for p in prompts]
    executor.executor_loop(requests, STEPS)
    torch.cuda.synchronize()

    ref = [[p] for p in prompts]  # plain eager greedy decode on the default stream
    for _ in range(STEPS):
        nxt = model(torch.tensor([r[-1] for r in ref], device=DEVICE)).argmax(-1).tolist()
        for r, t in zip(ref, nxt):
            r.append(t)
    print(f"steps={STEPS} match={ref == requests}")


if __name__ == "__main__":
    main()
