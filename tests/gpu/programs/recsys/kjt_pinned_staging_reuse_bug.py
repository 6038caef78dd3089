# Source: lightseekorg/tokenspeed PR #376 "fix: cpu buffer racing for sampling" (a pinned host buffer is
#   refilled for step k+1 while the H2D copy of step k is still queued on the stream), applied to the
#   KeyedJaggedTensor values/lengths upload of a recsys input pipeline (cf. pytorch/torchrec
#   torchrec/sparse/jagged_tensor.py, KeyedJaggedTensor.to(device, non_blocking=True)).
"""Input pipeline generator: each batch's jagged ids (values) and per-sample lengths are packed into one
reusable pinned staging buffer and shipped to the GPU with a single non_blocking copy on a copy stream;
the consumer pools the embeddings of each sample."""
import numpy as np
import torch

SLEEP_CYCLES = 20_000_000
DEV = torch.device("cuda", 0)
NUM_ROWS, DIM, B, N_VALUES, NUM_BATCHES = 50_000, 32, 1024, 16_384, 6


class PinnedKJTStager:
    def __init__(self, max_values, max_lengths):
        self._staging = torch.empty(max_values + max_lengths, dtype=torch.int64, pin_memory=True)
        self.copy_stream = torch.cuda.Stream()

    def stage(self, values, lengths):
        n, m = len(values), len(lengths)
        self._staging[:n].copy_(torch.from_numpy(values))
        self._staging[n:n + m].copy_(torch.from_numpy(lengths))
        with torch.cuda.stream(self.copy_stream):
            # the copy stream is still busy with this batch's dense-feature transfers
            torch.cuda._sleep(SLEEP_CYCLES)
            packed = self._staging[:n + m].to(DEV, non_blocking=True)
        return packed, n, m


def kjt_batches(stager, raw_batches):
    for values, lengths in raw_batches:
        packed, n, m = stager.stage(values, lengths)
        yield packed, n, m


def pooled_lookup(table, values, lengths):
    offsets = torch.cumsum(lengths, 0)
    positions = torch.arange(values.numel(), device=DEV)
    segment = torch.searchsorted(offsets, positions, right=True).clamp_(max=lengths.numel() - 1)
    out = torch.zeros(lengths.numel(), DIM, device=DEV)
    out.index_add_(0, segment, table.index_select(0, torch.remainder(values, NUM_ROWS)))
    return out


def make_raw_batches(rng):
    batches = []
    for _ in range(NUM_BATCHES):
        # random per-sample lengths that always add up to N_VALUES
        cuts = np.sort(rng.integers(0, N_VALUES + 1, size=B - 1))
        lengths = np.diff(np.concatenate([[0], cuts, [N_VALUES]])).astype(np.int64)
        values = rng.integers(0, NUM_ROWS, size=N_VALUES, dtype=np.int64)
        batches.append((values, lengths))
    return batches


def reference(table_cpu, raw_batches):
    outs = []
    for values, lengths in raw_batches:
        segment = torch.from_numpy(np.repeat(np.arange(B), lengths))
        out = torch.zeros(B, DIM)
        out.index_add_(0, segment, table_cpu[torch.from_numpy(values)])
        outs.append(out)
    return torch.stack(outs)


def main():
    rng = np.random.default_rng(0)
    raw_batches = make_raw_batches(rng)
    table_cpu = torch.randn(NUM_ROWS, DIM, generator=torch.Generator().manual_seed(0))
    table = table_cpu.to(DEV)
    stager = PinnedKJTStager(N_VALUES, B)
    torch.cuda.synchronize()

    outs = []
    cur = torch.cuda.current_stream()
    for packed, n, m in kjt_batches(stager, raw_batches):
        cur.wait_stream(stager.copy_stream)
        packed.record_stream(cur)
        outs.append(pooled_lookup(table, packed[:n], packed[n:n + m]))
    got = torch.stack(outs).cpu()
    torch.cuda.synchronize()

    ref = reference(table_cpu, raw_batches)
    match = torch.allclose(got, ref, rtol=1e-4, atol=1e-4)
    checksum, ref_checksum = got.abs().sum().item(), ref.abs().sum().item()
    torch.cuda.synchronize()
    print(f"checksum={checksum:.4f} reference={ref_checksum:.4f} match={match}")


if __name__ == "__main__":
    main()
