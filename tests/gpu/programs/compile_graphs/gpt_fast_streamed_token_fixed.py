# Source: pytorch-labs/gpt-fast generate.py, decode_n_tokens() / decode_one_token() with
#         decode_one_token = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True).
#         gpt-fast does `new_tokens.append(next_token.clone()); callback(new_tokens[-1])` because the
#         compiled function's output lives in the CUDA-graph-tree pool and is overwritten by the next replay.
#         Here the callback is a token streamer that copies each token to pinned host memory on its own stream.
# Bug: the streamer callback is handed the raw reduce-overhead output `next_token`. Its D2H copy on
#      streamer.stream (which only waits for the producer) is still queued when the next decode step's graph
#      replay rewrites the same cudagraph-pool output buffer on the default stream: streamer-stream read vs
#      default-stream write (next replay) of next_token's storage, no event from the streamer back to the
#      decode loop. The streamed tokens come out as later steps' tokens.
# Fix: pass the clone (`callback(new_tokens[-1])`, as gpt-fast does); the clone is made on the default stream
#      before the next replay, is never written again, and stays referenced in new_tokens until the end.
import torch

DEVICE = torch.device("cuda:0")
SLEEP_CYCLES = 20_000_000  # ~10 ms on an H200
VOCAB, DIM, MAX_POS, BATCH, NEW_TOKENS = 512, 128, 64, 8, 12


class Transformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(VOCAB, DIM)
        self.pos_embeddings = torch.nn.Embedding(MAX_POS, DIM)
        self.w1 = torch.nn.Linear(DIM, DIM, bias=False)
        self.output = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx, input_pos):
        h = self.tok_embeddings(idx) + self.pos_embeddings(input_pos)
        h = h + torch.tanh(self.w1(h))
        return self.output(h)


def decode_one_token(model, x, input_pos):
    logits = model(x, input_pos)
    return torch.argmax(logits, dim=-1)


decode_one_token = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)


class TokenStreamer:
    """Streams every new token to the host without blocking the decode loop."""

    def __init__(self, num_tokens):
        self.stream = torch.cuda.Stream()
        self.host_tokens = torch.zeros(num_tokens, BATCH, dtype=torch.int64, pin_memory=True)
        self.count = 0

    def __call__(self, token):
        self.stream.wait_stream(torch.cuda.current_stream())  # token is produced on the decode stream
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # stand-in for a busy copy engine / detokenizer stream
            self.host_tokens[self.count].copy_(token, non_blocking=True)
        self.count += 1

    def finish(self):
        self.stream.synchronize()
        return self.host_tokens[: self.count].tolist()


def decode_n_tokens(model, cur_token, input_pos, num_new_tokens, callback=lambda _: None):
    new_tokens = []
    for _ in range(num_new_tokens):
        torch.compiler.cudagraph_mark_step_begin()
        next_token = decode_one_token(model, cur_token, input_pos)
        input_pos += 1
        new_tokens.append(next_token.clone())
        callback(new_tokens[-1])  # FIX: hand out the clone, never the cudagraph-owned output buffer
        cur_token = next_token.clone()
    return new_tokens


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = Transformer().to(DEVICE).eval()
    prompt_last = torch.randint(0, VOCAB, (BATCH,), device=DEVICE)

    # compile warm-up (gpt-fast runs a throw-away generation first): warmup, record, replay
    decode_n_tokens(model, prompt_last.clone(), torch.tensor([0], device=DEVICE), 3)
    torch.cuda.synchronize()

    streamer = TokenStreamer(NEW_TOKENS)
    new_tokens = decode_n_tokens(model, prompt_last.clone(), torch.tensor([0], device=DEVICE),
                                 NEW_TOKENS, callback=streamer)
    streamed = streamer.finish()
    torch.cuda.synchronize()
    reference = torch.stack(new_tokens).tolist()
    print(f"tokens={len(streamed)} match={streamed == reference}")


if __name__ == "__main__":
    main()
