"""Index-addressed ops on disjoint rows of one tensor, from two streams without an ordering edge: legal when the
indices name different rows, a race when they share one. The paged KV caches of vLLM, SGLang and LMCache work so:
a load stream fills free blocks with ``index_copy_`` while compute gathers other blocks with ``index_select``,
and their indices are built on the host and copied to the device (``torch.tensor(..., pin_memory=True).to(dev,
non_blocking=True)``, or a persistent device buffer filled by ``gpu[:n].copy_(cpu[:n], non_blocking=True)``),
made by ``torch.arange`` or ``torch.tensor(..., device=...)``, or computed on the device from such (``.long()``,
``table[rows] * BLOCK + offsets``). streamsan reads the indices' values where they are on the host, at the copy,
and computes the device ops' results on the host (``streamsan.tracers.indices``). Indices it cannot know
(overwritten on the device by an op it cannot compute) count as touching every row: those scenarios expect the
finding a conservative answer gives.

Each pair: the program with rows in common (a race), and the same with disjoint rows (clean). The compute stream
is kept busy first, so the unordered work really overlaps.
"""

import pytest
import torch
from tests.gpu.support.scenario_kit import scenario_tests, streams


BLOCKS, BLOCK, DIM = 32, 16, 64
BUSY = 2_000_000


def _cache():
    return torch.zeros(BLOCKS, BLOCK, DIM, device="cuda", dtype=torch.float16)


def _h2d(values):
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to("cuda", non_blocking=True)


def _load_while_attending(load_blocks, read_blocks):
    """A prefix load into ``load_blocks`` on the load stream (staging copy, then ``index_copy_``) while compute
    gathers ``read_blocks``; compute waits for the load only before it reads the loaded blocks."""
    (load,) = streams("load")
    cache = _cache()
    host = torch.randn(len(load_blocks), BLOCK, DIM, dtype=torch.float16).pin_memory()
    torch.cuda.synchronize()
    done = torch.cuda.Event()
    with torch.cuda.stream(load):
        staging = host.to("cuda", non_blocking=True)
        cache.index_copy_(0, _h2d(load_blocks), staging)
        done.record()
    torch.cuda._sleep(BUSY)
    out = cache.index_select(0, _h2d(read_blocks)).float().sum()
    torch.cuda.current_stream().wait_event(done)
    out += cache.index_select(0, _h2d(load_blocks)).float().sum()
    return out.item()


def load_into_the_block_compute_reads():
    _load_while_attending([5, 0], [0, 1, 2, 3, 4])


def load_into_free_blocks():
    _load_while_attending([5, 6], [0, 1, 2, 3, 4])


def _offloading_block_0():
    """(the offload stream, the cache, the pinned host block): the offload stream, ordered after everything so
    far and kept busy, then copying block 0 of the cache out to the host block."""
    (offload,) = streams("offload")
    cache = _cache()
    host_block = torch.empty(BLOCK, DIM, dtype=torch.float16, pin_memory=True)
    torch.cuda.synchronize()
    offload.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(offload):
        torch.cuda._sleep(BUSY)
        host_block.copy_(cache[0], non_blocking=True)
    return offload, cache, host_block


def _slot_writes_while_offloading(slots):
    """vLLM's offloading connector after its fix orders each store after the KV writes so far; compute then writes
    the next token's slots (a persistent slot-mapping buffer, refilled from pinned memory each step) while the
    offload stream still copies full block 0 to the host: legal while the new slots are in other blocks."""
    slot_cpu = torch.zeros(64, dtype=torch.int64, pin_memory=True)
    slot_gpu = torch.zeros(64, dtype=torch.int64, device="cuda")
    offload, cache, host_block = _offloading_block_0()
    slots_view = cache.view(-1, DIM)
    n = len(slots)
    slot_cpu[:n] = torch.tensor(slots)
    slot_gpu[:n].copy_(slot_cpu[:n], non_blocking=True)
    slots_view.index_copy_(0, slot_gpu[:n], torch.ones(n, DIM, device="cuda", dtype=torch.float16))
    offload.synchronize()
    return cache.float().sum().item() + host_block.float().sum().item()


def token_written_into_the_block_being_offloaded():
    _slot_writes_while_offloading([BLOCK - 1])


def token_written_into_the_next_block():
    _slot_writes_while_offloading([BLOCK, BLOCK + 1])


def _slots_from_block_table(slot_block):
    """Slots computed on the device as ``block_table[rows] * BLOCK + offsets`` (vLLM's slot mapping, before its
    Triton kernel), from a block table and offsets made with ``torch.tensor(..., device=...)`` and converted with
    ``.long()``: the compute stream writes the new tokens' KV there while the offload stream copies block 0 out. The
    tracer computes the slots on the host from the values it knows."""
    offload, cache, host_block = _offloading_block_0()
    block_table = torch.tensor([[7, slot_block], [2, 9]], device="cuda", dtype=torch.int32)
    offsets = torch.tensor([3, 4], device="cuda")
    slots = block_table[torch.tensor([0, 0], device="cuda"), torch.tensor([1, 1], device="cuda")].long() * BLOCK
    slots += offsets
    cache.view(-1, DIM).index_copy_(0, slots, torch.ones(2, DIM, device="cuda", dtype=torch.float16))
    offload.synchronize()
    return cache.float().sum().item() + host_block.float().sum().item()


def slots_computed_into_the_block_being_offloaded():
    _slots_from_block_table(0)


def slots_computed_into_another_block():
    _slots_from_block_table(5)


def _gather_arange_rows(start):
    """Rows named by ``torch.arange`` (known without reading them) gathered on a side stream while compute updates
    rows 0-7 in place."""
    (side,) = streams("side")
    table = torch.zeros(64, DIM, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY)
        got = table[torch.arange(start, start + 8, device="cuda")].sum()
    table[:8].add_(1.0)
    side.synchronize()
    return got.item()


def arange_rows_overlap_the_update():
    _gather_arange_rows(4)


def arange_rows_past_the_update():
    _gather_arange_rows(8)


def _indices_changed_on_the_device(shift):
    """Indices copied from the host and then shifted on the device: their values are no longer the copied ones,
    so the gather counts as reading every row (a race with the side stream's write of row 20 either way)."""
    (side,) = streams("side")
    table = torch.zeros(64, DIM, device="cuda")
    rows = torch.ones(1, DIM, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY)
        table.index_copy_(0, _h2d([20]), rows)
    idx = _h2d([0, 1, 2])
    idx.add_(torch.full((3,), shift, device="cuda", dtype=torch.int64))  # (an op of the C tracer's)
    got = table.index_select(0, idx).sum()
    side.synchronize()
    return got.item()


def indices_shifted_onto_the_written_row():
    _indices_changed_on_the_device(19)


def indices_shifted_elsewhere_still_unknown():
    _indices_changed_on_the_device(3)


SCENARIOS = [
    load_into_the_block_compute_reads, load_into_free_blocks,
    token_written_into_the_block_being_offloaded, token_written_into_the_next_block,
    slots_computed_into_the_block_being_offloaded, slots_computed_into_another_block,
    arange_rows_overlap_the_update, arange_rows_past_the_update,
    indices_shifted_onto_the_written_row, indices_shifted_elsewhere_still_unknown,
]

EXPECTED = {
    "load_into_the_block_compute_reads": [
        ("device-device", "load", "aten::index_copy_", "default", "aten::index_select"),
    ],
    "load_into_free_blocks": [],
    "token_written_into_the_block_being_offloaded": [
        ("device-device", "offload", "aten::copy_", "default", "aten::index_copy_"),
    ],
    "token_written_into_the_next_block": [],
    "slots_computed_into_the_block_being_offloaded": [
        ("device-device", "offload", "aten::copy_", "default", "aten::index_copy_"),
    ],
    "slots_computed_into_another_block": [],
    "arange_rows_overlap_the_update": [
        ("device-device", "side", "aten::index.Tensor", "default", "aten::add_.Tensor"),
    ],
    "arange_rows_past_the_update": [],
    "indices_shifted_onto_the_written_row": [
        ("device-device", "side", "aten::index_copy_", "default", "aten::index_select"),
    ],
    "indices_shifted_elsewhere_still_unknown": [
        ("device-device", "side", "aten::index_copy_", "default", "aten::index_select"),
    ],
}

test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED)


def test_the_finding_names_the_common_rows(san):
    """The race of a load into block 0 while compute gathers blocks 0-4 is on block 0 alone."""
    session, _ = san(load_into_the_block_compute_reads)
    (f,) = session.findings
    assert (f.hi - f.lo) == BLOCK * DIM * 2


@pytest.mark.parametrize("program", [load_into_free_blocks, token_written_into_the_next_block,
                                     slots_computed_into_another_block])
def test_results_are_unchanged(program):
    """The tracer reads index values on the host only: what the program computes is what it computes untraced."""
    import streamsan

    torch.manual_seed(0)
    want = program()
    torch.cuda.synchronize()
    torch.manual_seed(0)
    with streamsan.watch():
        got = program()
    assert got == want
