# Source: transformers src/transformers/models/bert/modeling_bert.py (BertModel.forward -> last_hidden_state)
#   and tokenization_utils_base.BatchEncoding.to(device, non_blocking=...); the sentence-embedding recipe
#   (masked mean pooling + L2 normalize) used with BERT-style encoders, with the result exported to a host-side
#   vector index through `.to("cpu", non_blocking=True)` to avoid a sync per batch.
# Bug: `emb.to("cpu", non_blocking=True)` enqueues a device->host copy on the default stream into a freshly
#   pinned host tensor and returns at once. EmbeddingIndex.add() then reads that pinned tensor on the host
#   (a CPU copy_ into the index) without any synchronization: host read vs default-stream D2H write of the
#   same pinned bytes. With the GPU still busy, the index receives zeros / stale rows.
# Fix: torch.cuda.current_stream().synchronize() before the host reads the exported embeddings.
# This file: FIXED version.
import torch
import torch.nn.functional as F
from transformers import BatchEncoding, BertConfig, BertModel

DEVICE = torch.device("cuda", 0)
VOCAB, SEQ, BATCH, N_BATCHES = 4000, 128, 64, 6
SLEEP_CYCLES = 40_000_000  # ~20 ms: a deeper encoder still running when the host moves on


class EmbeddingIndex:
    """Host-side store of normalized sentence embeddings (pageable memory, grows by batches)."""

    def __init__(self, capacity, dim):
        self.vectors = torch.zeros(capacity, dim)
        self.size = 0

    def add(self, emb):
        n = emb.shape[0]
        self.vectors[self.size:self.size + n].copy_(emb)
        self.size += n


@torch.no_grad()
def encode(model, batch):
    hidden = model(**batch).last_hidden_state
    torch.cuda._sleep(SLEEP_CYCLES)
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    emb = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    emb = F.normalize(emb, dim=-1)
    return emb.to("cpu", non_blocking=True)  # pinned host tensor, filled asynchronously


def make_shards(n_batches, seed=0):
    """Pre-tokenized shards (ids + padding masks), as a tokenizer would have produced them."""
    g = torch.Generator().manual_seed(seed)
    shards = []
    for _ in range(n_batches):
        lengths = torch.randint(16, SEQ + 1, (BATCH,), generator=g)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=g) * mask
        shards.append({"input_ids": ids, "attention_mask": mask})
    return shards


def main():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=SEQ)
    model = BertModel(config, add_pooling_layer=False).to(DEVICE).eval()
    shards = make_shards(N_BATCHES)
    index = EmbeddingIndex(N_BATCHES * BATCH, config.hidden_size)
    torch.cuda.synchronize()

    for shard in shards:
        emb = encode(model, BatchEncoding(dict(shard)).to(DEVICE))
        torch.cuda.current_stream().synchronize()  # FIX: the D2H copy into `emb` must be complete
        index.add(emb)
    torch.cuda.synchronize()

    # Reference: same encoder, blocking export (.cpu()) per batch.
    refs = []
    with torch.no_grad():
        for shard in shards:
            batch = BatchEncoding(dict(shard)).to(DEVICE)
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            refs.append(F.normalize((hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0), dim=-1).cpu())
    ref = torch.cat(refs)
    worst = (ref - index.vectors[:index.size]).abs().max().item()
    ok = index.size == ref.shape[0] and torch.allclose(ref, index.vectors[:index.size], rtol=1e-4, atol=1e-5)
    print(f"rows={index.size} max_abs_diff={worst:.3e}")
    print(f"match={ok}")


if __name__ == "__main__":
    main()
