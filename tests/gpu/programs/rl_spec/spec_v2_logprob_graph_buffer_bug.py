# Source: sgl-project/sglang issue #19761 "Support logprobs for spec v2 (overlap-safe)" and
#   python/sglang/srt/speculative/eagle_worker_v2.py verify() replaying the target-verify CUDA graph
#   whose logits live in a static next_token_logits_buffer ("CUDA graph replay reuses fixed
#   buffers, so views of next_token_logits_buffer are unsafe across iterations").
# Bug: the scheduler stream computes the verify logprobs (log_softmax + max) from
#   logits_output.next_token_logits, a view of the graph's static output buffer. It waits for the
#   verify (verify_done event), but the forward stream never waits for that read before replaying
#   the graph for the next batch, so replay N+1 overwrites the buffer before the (busy) scheduler
#   stream reads batch N's logits (device-device WAR race on next_token_logits_buffer).
# Fix: the scheduler records logprob_done after its read and the forward stream waits on it
#   (forward_stream.wait_event(logprob_done)) before the next replay.
from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda:0")
BS = 8
NUM_DRAFT_TOKENS = 4
HIDDEN = 256
VOCAB = 8192
NUM_STEPS = 6


@dataclass
class LogitsOutput:
    next_token_logits: torch.Tensor


class TargetVerifyCudaGraphRunner:
    def __init__(self, lm_head):
        n = BS * NUM_DRAFT_TOKENS
        self.lm_head = lm_head
        self.input_hidden = torch.zeros(n, HIDDEN, device=DEVICE)
        self.next_token_logits_buffer = torch.zeros(n, VOCAB, device=DEVICE)
        warmup = torch.cuda.Stream(device=DEVICE)
        warmup.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warmup):
            self._forward()
        torch.cuda.current_stream().wait_stream(warmup)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._forward()
        torch.cuda.synchronize()

    def _forward(self):
        torch.matmul(self.input_hidden, self.lm_head.t(), out=self.next_token_logits_buffer)

    def replay(self, hidden):
        self.input_hidden.copy_(hidden)
        self.graph.replay()
        return LogitsOutput(next_token_logits=self.next_token_logits_buffer)


class EAGLEWorkerV2:
    def __init__(self, lm_head):
        self.forward_stream = torch.cuda.Stream(device=DEVICE)
        self.graph_runner = TargetVerifyCudaGraphRunner(lm_head)
        self.last_logprob_done = None

    def verify(self, hidden):
        with torch.cuda.stream(self.forward_stream):
            logits_output = self.graph_runner.replay(hidden)
            predict = torch.argmax(logits_output.next_token_logits, dim=-1)
            predict_cpu = predict.to("cpu", non_blocking=True)
            verify_done = torch.cuda.Event()
            verify_done.record()
        return logits_output, predict_cpu, verify_done


class Scheduler:
    def launch_logprobs(self, logits_output, verify_done):
        stream = torch.cuda.current_stream()
        stream.wait_event(verify_done)
        torch.cuda._sleep(30_000_000)  # penalties / grammar masks already queued on this stream
        logprobs = torch.log_softmax(logits_output.next_token_logits, dim=-1)
        token_logprobs = logprobs.max(dim=-1).values
        token_logprobs_cpu = token_logprobs.to("cpu", non_blocking=True)
        logprob_done = torch.cuda.Event()
        logprob_done.record(stream)
        return token_logprobs_cpu, logprob_done

    def process_batch_result(self, predict_cpu, verify_done, token_logprobs_cpu, logprob_done):
        verify_done.synchronize()
        logprob_done.synchronize()
        return predict_cpu.tolist(), token_logprobs_cpu.tolist()


def main():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    lm_head = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g) / HIDDEN ** 0.5
    hiddens = [torch.randn(BS * NUM_DRAFT_TOKENS, HIDDEN, device=DEVICE, generator=g)
               for _ in range(NUM_STEPS)]
    worker = EAGLEWorkerV2(lm_head)
    scheduler = Scheduler()
    torch.cuda.synchronize()

    results, pending = [], None
    for step in range(NUM_STEPS):
        logits_output, predict_cpu, verify_done = worker.verify(hiddens[step])
        token_logprobs_cpu, logprob_done = scheduler.launch_logprobs(logits_output, verify_done)
        worker.last_logprob_done = logprob_done
        if pending is not None:  # overlap: process batch N-1 after launching batch N
            results.append(scheduler.process_batch_result(*pending))
        pending = (predict_cpu, verify_done, token_logprobs_cpu, logprob_done)
    results.append(scheduler.process_batch_result(*pending))

    torch.cuda.synchronize()
    match = True
    for step, (tokens, token_logprobs) in enumerate(results):
        ref_lp = torch.log_softmax(hiddens[step] @ lm_head.t(), dim=-1).max(dim=-1).values
        if not torch.allclose(torch.tensor(token_logprobs), ref_lp.cpu(), atol=1e-4, rtol=1e-4):
            match = False
            print(f"step {step}: logprobs belong to another batch")
    print(f"match={match}")


if __name__ == "__main__":
    main()
