"""Index-addressed ops touch the rows their indices name, when the tracer saw the indices' values on the host
(``streamsan.tracers.indices``). CPU: the geometry and the store alone, then the torch tracer's dispatch with CPU
tensors that say they are on CUDA (the copies from the host that teach it the values are real CPU copies)."""

import pytest

torch = pytest.importorskip("torch")

from streamsan import events as E  # noqa: E402
from streamsan.analysis.analyzer import Analyzer  # noqa: E402
from streamsan.analysis.findings import DEVICE_DEVICE  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers import indices  # noqa: E402
from streamsan.tracers.torch import device  # noqa: E402
from streamsan.tracers.torch.dispatch import dispatch as traced_dispatch  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402
from streamsan.tracers.indices import IndexValues, row_ranges, rows_of  # noqa: E402
from tests.support.torch_kit import CudaLike  # noqa: E402

aten = torch.ops.aten


def like(t):
    return t.as_subclass(CudaLike)


# ------------------------------------------------------------------ geometry
def test_consecutive_rows_make_one_range_each_run():
    # a contiguous [10, 4] float32 tensor at 1000: rows 2-3 and 7
    assert row_ranges(0, 1000, 4, (10, 4), (4, 1), 0, [2, 3, 7]) == [(0, 1000 + 2 * 16, 32), (0, 1000 + 7 * 16, 16)]


def test_rows_along_an_inner_dimension_are_strided():
    # [2, 8, 3] int64, dim 1, rows 4-5: two blocks of 2 x 3 elements, 8 rows apart; from element 12 (0, 4, 0)
    # to element 41 (1, 5, 2)
    got = row_ranges(0, 0, 8, (2, 8, 3), (24, 3, 1), 1, [4, 5])
    assert got == [(0, 12 * 8, (41 - 12 + 1) * 8, (8, (2, 2, 3), (24, 3, 1)))]


def test_past_max_runs_the_hull_of_the_rows():
    rows = list(range(0, 2 * indices.MAX_RUNS + 2, 2))
    assert row_ranges(0, 0, 1, (1000,), (1,), 0, rows) == [(0, 0, rows[-1] + 1)]


@pytest.mark.parametrize("values, size, rows", [
    ([3, 1, 3], 5, [1, 3]),
    ([-1, 0], 5, [0, 4]),  # negative indices count from the end (x[idx])
    ([5], 5, None),  # out of bounds: the op fails, nothing is refined
    ([-6], 5, None),
])
def test_rows_of(values, size, rows):
    assert rows_of(values, size) == rows


# ------------------------------------------------------------------ the store
def test_values_of_a_slice_of_a_learned_buffer():
    known = IndexValues()
    buf = like(torch.zeros(8, dtype=torch.int64))
    known.learn(buf, list(range(10, 18)))
    assert known.values_of(buf[2:5]) == [12, 13, 14]
    assert known.values_of(buf[::2]) is None  # not contiguous
    assert known.values_of(buf.view(torch.int32)) is None  # another dtype
    assert known.values_of(like(torch.zeros(3, dtype=torch.int64))) is None  # other memory


def test_a_write_over_the_span_forgets_it():
    known = IndexValues()
    buf = like(torch.zeros(8, dtype=torch.int64))
    known.learn(buf, list(range(8)))
    p = buf.data_ptr()
    known.written([(0, p + 64, 8)])  # the bytes just past it
    assert known.values_of(buf) == list(range(8))
    known.written([(1, p, 8)])  # another device
    assert known.values_of(buf) == list(range(8))
    known.written([(0, p + 56, 8)])  # the last element
    assert known.values_of(buf) is None and known.values_of(buf[:7]) == list(range(7))
    known.written([(0, p, 64)])
    assert known.spans == []


def test_a_write_over_part_of_the_span_keeps_the_rest():
    """vLLM's persistent slot mapping: copied from the host, then its tail filled with -1 on the device."""
    known = IndexValues()
    buf = like(torch.zeros(8, dtype=torch.int64))
    known.learn(buf, list(range(8)))
    p = buf.data_ptr()
    known.written([(0, p + 3 * 8, 2 * 8)])  # elements 3 and 4
    assert known.values_of(buf[:3]) == [0, 1, 2] and known.values_of(buf[5:]) == [5, 6, 7]
    assert known.values_of(buf[2:6]) is None


@pytest.mark.parametrize("data, values", [
    ([[1, 2], [3, 4]], [1, 2, 3, 4]),
    (torch.tensor([5, 6]), [5, 6]),
    (pytest.importorskip("numpy").arange(3), [0, 1, 2]),
    ([1.5, 2.0], None),  # not integers
])
def test_values_of_tensor_data(data, values):
    known = IndexValues()
    n = len(values) if values else 2
    out = like(torch.zeros(n, dtype=torch.int64))
    known.learn_data(out, data)
    assert known.values_of(out) == values


def test_another_storage_at_the_same_address_is_not_the_learned_one():
    known = IndexValues()
    buf = like(torch.zeros(4, dtype=torch.int64))
    known.learn(buf, [1, 2, 3, 4])
    other = like(torch.empty(0, dtype=torch.int64))
    other.set_(torch.UntypedStorage(32), 0, (4,))  # (a new storage object, as after a free and reuse)
    assert known.values_of(other) is None


def test_arange_values():
    known = IndexValues()
    out = like(torch.arange(3, 15, 4))
    known.learn_arange(out, (3, 15, 4), {})
    assert list(known.values_of(out)) == [3, 7, 11]
    floats = like(torch.arange(3.0))
    known.learn_arange(floats, (3.0,), {})
    assert known.values_of(floats) is None


# ------------------------------------------------------------------ the tracer
LOAD, COMPUTE = 0x10, 0x20


@pytest.fixture
def traced(monkeypatch):
    """(dispatch(op, *args, stream=...), analyzer): ops dispatched by the torch tracer on two streams."""
    analyzer = Analyzer()
    tracer = TorchTracer(EventBuffer([analyzer.feed]))
    current = {"stream": COMPUTE}
    monkeypatch.setattr(device, "raw_stream", lambda dev: current["stream"])
    tracer.tracing = True

    def dispatch(op, *args, stream=COMPUTE, **kwargs):
        current["stream"] = stream
        return traced_dispatch(tracer, op, args, kwargs)

    yield dispatch, analyzer, tracer
    tracer.tracing = False


def findings(analyzer, tracer):
    tracer.buffer.flush()
    analyzer.finish()
    return [(f.kind, f.previous.name, f.current.name) for f in analyzer.sorted_findings()]


def staged(dispatch, values, stream=COMPUTE):
    """A device index tensor filled by a copy from the host (on the compute stream)."""
    idx = like(torch.zeros(len(values), dtype=torch.int64))
    dispatch(aten.copy_.default, idx, torch.tensor(values), stream=stream)
    return idx


def test_disjoint_rows_on_two_streams_are_no_race(traced):
    """The paged-KV pattern: a load stream fills free blocks while compute reads other blocks."""
    dispatch, analyzer, tracer = traced
    cache = like(torch.zeros(16, 4))
    src = like(torch.ones(2, 4))
    dispatch(aten.index_copy_.default, cache, 0, staged(dispatch, [5, 6]), src, stream=LOAD)
    dispatch(aten.index_select.default, cache, 0, staged(dispatch, [0, 1, 2, 3, 4]))
    assert findings(analyzer, tracer) == []


def test_a_common_row_races(traced):
    dispatch, analyzer, tracer = traced
    cache = like(torch.zeros(16, 4))
    dispatch(aten.index_copy_.default, cache, 0, staged(dispatch, [4, 5]), like(torch.ones(2, 4)), stream=LOAD)
    out = dispatch(aten.index_select.default, cache, 0, staged(dispatch, [0, 1, 2, 3, 4]))
    assert out.shape == (5, 4)  # (the op ran as without streamsan)
    assert findings(analyzer, tracer) == [(DEVICE_DEVICE, "aten::index_copy_", "aten::index_select")]


def test_advanced_indexing_reads_the_rows_of_its_index_dimension(traced):
    """``x[:, idx]`` (indices [None, idx]) and ``x[idx] = v`` (index_put_), with a negative index."""
    dispatch, analyzer, tracer = traced
    x = like(torch.zeros(4, 10))
    dispatch(aten.index_put_.default, x, [None, staged(dispatch, [-1])], like(torch.ones(4, 1)), stream=LOAD)
    dispatch(aten.index.Tensor, x, [None, staged(dispatch, [0, 8])])
    assert findings(analyzer, tracer) == []
    dispatch(aten.index.Tensor, x, [None, staged(dispatch, [9])])
    assert findings(analyzer, tracer) == [(DEVICE_DEVICE, "aten::index_put_", "aten::index.Tensor")]


def test_indices_overwritten_on_the_device_are_unknown(traced):
    """After a device op writes the index tensor, its values are not the copied ones: the whole tensor counts."""
    dispatch, analyzer, tracer = traced
    cache = like(torch.zeros(16, 4))
    dispatch(aten.index_copy_.default, cache, 0, staged(dispatch, [9]), like(torch.ones(1, 4)), stream=LOAD)
    idx = staged(dispatch, [0, 1])
    dispatch(aten.add_.Tensor, idx, like(torch.ones(2, dtype=torch.int64)))
    dispatch(aten.index_select.default, cache, 0, idx)
    assert findings(analyzer, tracer) == [(DEVICE_DEVICE, "aten::index_copy_", "aten::index_select")]


def test_indices_made_on_the_device_are_unknown(traced):
    dispatch, analyzer, tracer = traced
    cache = like(torch.zeros(16, 4))
    dispatch(aten.index_copy_.default, cache, 0, like(torch.tensor([9])), like(torch.ones(1, 4)), stream=LOAD)
    dispatch(aten.index_select.default, cache, 0, staged(dispatch, [0]))
    assert findings(analyzer, tracer) == [(DEVICE_DEVICE, "aten::index_copy_", "aten::index_select")]


def test_indices_computed_on_the_device_from_known_ones_are_known(traced):
    """Slots made on the device as block * BLOCK + offset from a block table and offsets copied from the host, then
    converted with ``.long()`` and concatenated: the tracer runs the same ops on the host values it knows."""
    dispatch, analyzer, tracer = traced
    cache = like(torch.zeros(64, 4))
    blocks = staged(dispatch, [3, 1], stream=LOAD)
    offsets = like(torch.zeros(2, dtype=torch.int32))
    dispatch(aten.copy_.default, offsets, torch.tensor([5, 6], dtype=torch.int32), stream=LOAD)
    base = dispatch(aten.mul.Tensor, blocks, torch.tensor(8), stream=LOAD)
    wide = dispatch(aten._to_copy.default, offsets, dtype=torch.int64, stream=LOAD)
    slots = dispatch(aten.add.Tensor, base, wide, stream=LOAD)
    more = dispatch(aten.cat.default, [slots, staged(dispatch, [40], stream=LOAD)], stream=LOAD)
    assert tracer.index_values.values_of(more) == [29, 14, 40]
    dispatch(aten.index_copy_.default, cache, 0, more, like(torch.ones(3, 4)), stream=LOAD)
    dispatch(aten.index_select.default, cache, 0, staged(dispatch, [0, 15, 28, 30, 41]))
    assert findings(analyzer, tracer) == []
    dispatch(aten.index_select.default, cache, 0, staged(dispatch, [14]))
    assert findings(analyzer, tracer) == [(DEVICE_DEVICE, "aten::index_copy_", "aten::index_select")]


def test_a_fill_of_known_values_is_known(traced):
    dispatch, analyzer, tracer = traced
    idx = staged(dispatch, [1, 2, 3, 4])
    dispatch(aten.fill_.Scalar, idx[2:], -1)
    assert tracer.index_values.values_of(idx) is None  # (two spans now)
    assert tracer.index_values.values_of(idx[:2]) == [1, 2] and tracer.index_values.values_of(idx[2:]) == [-1, -1]


def test_an_embedding_reads_the_rows_of_its_ids(traced):
    dispatch, analyzer, tracer = traced
    table = like(torch.zeros(16, 4))
    dispatch(aten.index_copy_.default, table, 0, staged(dispatch, [3]), like(torch.ones(1, 4)), stream=LOAD)
    ids = like(torch.zeros(2, 2, dtype=torch.int64))
    dispatch(aten.copy_.default, ids, torch.tensor([[0, 1], [2, 4]]))
    dispatch(aten.embedding.default, table, ids)
    assert findings(analyzer, tracer) == []


def test_threads_learning_and_forgetting_at_once():
    """Threads dispatch ops at once (PyTorch releases the GIL inside ops): the store stays consistent."""
    import threading

    known = IndexValues()
    bufs = [like(torch.zeros(8, dtype=torch.int64)) for _ in range(8)]
    errors = []

    def work(k):
        try:
            for i in range(2000):
                b = bufs[(k + i) % len(bufs)]
                known.learn(b, list(range(i, i + 8)))
                known.values_of(b[2:5])
                known.written([(0, b.data_ptr() + 8 * (i % 8), 8)])
        except Exception as exc:  # (an index out of range, a list changed during iteration...)
            errors.append(exc)

    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (threads switch between any two bytecodes: without the lock, this fails)
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert len(known.spans) == len(known._known) <= 2 * len(bufs)
    assert all((k.space, k.lo, k.hi) == s for k, s in zip(known._known, known.spans))
