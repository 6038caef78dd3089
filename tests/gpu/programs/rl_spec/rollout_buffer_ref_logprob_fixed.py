# Source: volcengine/verl verl/trainer/ppo/ray_trainer.py RayPPOTrainer.fit() data flow
#   (actor_rollout_wg.generate_sequences -> ref_policy_wg.compute_ref_log_prob -> KL penalty) and
#   DataParallelPPOActor.compute_log_prob (verl/workers/actor/dp_actor.py), colocated on one GPU.
#   Modelled optimization (not verl's literal code): the reference-policy logprob pass of batch N
#   overlaps the rollout of batch N+1 on a side stream, in the spirit of
#   recipe/one_step_off_policy's rollout/train overlap, and rollouts are written into a
#   preallocated double-buffered rollout buffer reused between iterations.
# Bug: the rollout for iteration N+2 acquires the same RolloutBufferPool slot as iteration N and
#   writes responses into it on the default stream. The reference-policy logprob pass of
#   iteration N runs on ref_stream (it waited for the rollout, RAW is fine), but the pool hands the
#   slot back out without ordering the default stream after ref_stream's reads, so the new
#   rollout overwrites the sequences while ref_stream (busy) has not read them yet (device-device
#   WAR race on the slot's sequences) -> ref logprobs/KL computed on the wrong responses.
# Fix: release() remembers the stream that last read the slot and acquire() makes the current
#   stream wait for it (torch.cuda.current_stream().wait_stream(reader)).
import torch

DEVICE = torch.device("cuda:0")
BATCH = 64
PROMPT_LEN = 16
RESPONSE_LEN = 24
HIDDEN = 128
VOCAB = 1024
NUM_ITERS = 6


class RolloutBufferPool:
    def __init__(self, num_slots):
        seq_len = PROMPT_LEN + RESPONSE_LEN
        self.sequences = torch.zeros(num_slots, BATCH, seq_len, dtype=torch.int64, device=DEVICE)
        self.free_slots = list(range(num_slots))
        self.last_reader = [None] * num_slots

    def acquire(self):
        slot = self.free_slots.pop(0)
        if self.last_reader[slot] is not None:
            torch.cuda.current_stream().wait_stream(self.last_reader[slot])
        return slot

    def release(self, slot, reader_stream):
        self.last_reader[slot] = reader_stream
        self.free_slots.append(slot)


class TinyLM:
    def __init__(self, seed):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        self.embed = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g)
        self.lm_head = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g) / HIDDEN ** 0.5

    def logits(self, tokens):
        return self.embed[tokens] @ self.lm_head.T


def generate_sequences(policy, prompts, seqs):
    # Greedy decode straight into the rollout buffer slot.
    seqs[:, :PROMPT_LEN].copy_(prompts)
    for t in range(PROMPT_LEN, PROMPT_LEN + RESPONSE_LEN):
        seqs[:, t] = policy.logits(seqs[:, t - 1]).argmax(-1)


def compute_ref_log_prob(ref_policy, seqs):
    logits = ref_policy.logits(seqs[:, PROMPT_LEN - 1:-1])
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, seqs[:, PROMPT_LEN:, None]).squeeze(-1)


def main():
    policy, ref_policy = TinyLM(seed=1), TinyLM(seed=2)
    pool = RolloutBufferPool(num_slots=2)
    ref_stream = torch.cuda.Stream(device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    all_prompts = [torch.randint(0, VOCAB, (BATCH, PROMPT_LEN), device=DEVICE, generator=g)
                   for _ in range(NUM_ITERS)]
    torch.cuda.synchronize()

    ref_log_probs, responses = [], []
    for it in range(NUM_ITERS):
        slot = pool.acquire()
        seqs = pool.sequences[slot]
        generate_sequences(policy, all_prompts[it], seqs)
        responses.append(seqs[:, PROMPT_LEN:].clone())  # kept for the final check only
        ref_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(ref_stream):
            torch.cuda._sleep(30_000_000)  # the reference model is much larger than this toy one
            ref_log_probs.append(compute_ref_log_prob(ref_policy, seqs))
        pool.release(slot, ref_stream)

    torch.cuda.synchronize()
    match = True
    for it in range(NUM_ITERS):
        seqs = torch.cat([all_prompts[it], responses[it]], dim=1)
        ref = compute_ref_log_prob(ref_policy, seqs)
        if not torch.allclose(ref, ref_log_probs[it], atol=1e-5):
            match = False
            print(f"iteration {it}: ref log-probs computed on overwritten responses")
    kl = torch.stack([r.mean() for r in ref_log_probs]).mean().item()
    print(f"mean ref logprob {kl:.4f}")
    print(f"match={match}")


if __name__ == "__main__":
    main()
