"""Bad input, fuzzed: the trace reader (TraceReader, replay_trace, ``streamsan replay``) and the report loader
(load_report, ``streamsan show``) under random bytes, truncations, single-byte corruptions, valid frames with
garbage payloads, valid marshal with wrong event shapes and JSON of the wrong shape.

The property everywhere: a report, or a TraceError / ReportError with a one-line message; through the CLI,
exit 0 / 66 with a report or exit 2 with exactly one ``streamsan: error:`` line; never another exception,
never a traceback, never a hang (a SIGALRM guard turns a hang into a failure). The budget is bounded and
deterministic (``derandomize``) so that CI runs the same examples every time.

test_cli.py covers the hand-picked cases (missing file, directory, bad magic, wrong format version, ...);
this file adds the generated ones and the enormous-file and unwritable-output cases.
"""

from __future__ import annotations

import contextlib
import io
import json
import marshal
import os
import signal
import struct
import time
import zlib

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamsan import events as E
from streamsan import exitcodes
from streamsan.cli import main
from streamsan.replay import replay_trace
from streamsan.report.io import ReportError, load_report
from streamsan.trace import MAGIC, MAX_FRAME, TraceError, TraceReader
from tests.support import report_scenarios as S
from tests.support.paths import ROOT

VALIDATOR = jsonschema.Draft202012Validator(json.loads((ROOT / "streamsan" / "report" / "schema.json").read_text()))
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
HANG_SECONDS = 20
FORMATS = ("text", "markdown", "json", "sarif", "html", "perfetto")


# ---------------------------------------------------------------- helpers
@contextlib.contextmanager
def no_hang(seconds=HANG_SECONDS):
    """Fail (instead of hanging the suite) if the body runs longer than ``seconds``."""
    def alarm(*_):
        raise AssertionError(f"no answer after {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def cli(*argv):
    """``streamsan ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with no_hang(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def assert_one_line(e: Exception):
    msg = str(e)
    assert msg and "\n" not in msg and "\r" not in msg, repr(msg)


def frame(kind: bytes, payload: bytes) -> bytes:
    """One trace frame with a correct checksum."""
    return struct.pack("<IIc", len(payload), zlib.crc32(payload, zlib.crc32(kind)), kind) + payload


def header_frame(header=None) -> bytes:
    h = {"format": "streamsan.trace/1", "pid": 1, "command": ["python", "run.py"]} if header is None else header
    return frame(b"H", zlib.compress(json.dumps(h).encode()))


def events_frame(batch) -> bytes:
    return frame(b"E", zlib.compress(marshal.dumps(batch, 4)))


def end_frame(footer=None) -> bytes:
    return frame(b"Z", zlib.compress(json.dumps({"events": 0, "complete": True} if footer is None
                                                else footer).encode()))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def valid_trace_bytes(work) -> bytes:
    """A small complete trace (the same bytes every time): two batches with a race and the stacks it names."""
    first = S.pinned_d2h_then_h2d(2)
    second = S.host_read_after_d2h()[len(S.prologue()):]
    good = (MAGIC + header_frame() + events_frame(first) + events_frame(second)
            + end_frame({"events": len(first) + len(second), "complete": True, "environment": {"python": "3"}}))
    (work / "valid.sstrace").write_bytes(good)
    return good


def check_trace(path, fmt="text"):
    """The property, for one trace file, through the reader and ``streamsan replay`` (replay_trace): a report
    that follows schema.json, or one error line."""
    with no_hang():
        try:
            r = TraceReader(str(path))
            for _ in r.batches():
                pass
        except TraceError as e:
            assert_one_line(e)
    out_path = path.with_suffix(".json")
    if out_path.exists():
        out_path.unlink()
    code, out, err = cli("replay", path, "--format", fmt, "--report", out_path)
    assert "Traceback" not in out + err
    if code == exitcodes.USAGE:
        assert out == "" and not out_path.exists()
        assert err.startswith("streamsan: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    else:
        assert code == exitcodes.OK and err == f"streamsan: report written to {out_path}\n", (code, err)
        rep = json.loads(out_path.read_text())
        VALIDATOR.validate(rep)
        assert all("\n" not in p for p in rep["problems"])


# ---------------------------------------------------------------- the trace reader
@FUZZ
@given(data=st.binary(max_size=512), magic=st.booleans())
def test_fuzz_random_bytes_as_trace(work, data, magic):
    p = work / "random.sstrace"
    p.write_bytes((MAGIC if magic else b"") + data)
    check_trace(p)


@FUZZ
@given(st.data())
def test_fuzz_truncated_and_corrupted_traces(work, data):
    good = valid_trace_bytes(work)
    cut = data.draw(st.integers(0, len(good)), label="cut")
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(1, 255)), max_size=1),
                      label="flip")
    buf = bytearray(good)
    for at, x in flips:
        buf[at] ^= x
    p = work / "damaged.sstrace"
    p.write_bytes(bytes(buf[:cut]) if data.draw(st.booleans(), label="truncate") else bytes(buf))
    check_trace(p)


def test_every_truncation_of_a_valid_trace(work):
    """Exhaustive over offsets: a prefix of a good trace is a report of its whole frames (or a header error)."""
    good = valid_trace_bytes(work)
    whole = []  # (end offset, events so far) of every complete frame
    r = TraceReader(str(work / "valid.sstrace"))
    n = 0
    for b in r.batches():
        n += len(b)
        whole.append((r.f.tell(), n))
    assert r.complete and n == len(S.pinned_d2h_then_h2d(2)) + len(S.host_read_after_d2h()) - len(S.prologue())
    header_end = len(MAGIC) + struct.unpack("<I", good[len(MAGIC):len(MAGIC) + 4])[0] + 9
    p = work / "cut.sstrace"
    for cut in range(0, len(good)):
        p.write_bytes(good[:cut])
        if cut < header_end:
            with pytest.raises(TraceError):
                replay_trace(str(p))
            continue
        rep = replay_trace(str(p))
        expected = max([ev for end, ev in whole if end <= cut], default=0)
        assert rep["complete"] is False and rep["summary"]["events"] == expected, cut


# marshal-able values: what a garbage event payload can hold
_LEAF = (st.none() | st.booleans() | st.integers() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=True)
         | st.text(max_size=8) | st.binary(max_size=8))
_VALUE = st.recursive(_LEAF, lambda c: st.lists(c, max_size=5) | st.lists(c, max_size=5).map(tuple)
                      | st.dictionaries(st.text(max_size=3), c, max_size=3), max_leaves=20)


def _templates():
    evs = S.pinned_d2h_then_h2d(1) + S.host_read_after_d2h(synchronized=True)
    evs += [E.event_record(1, 1), E.event_wait(1, 2), E.event_sync(1), E.device_sync(0), E.free(0, 0xA000),
            E.alloc(0, 0xA000, 4096, 2, 6), E.record_stream(0, 0xA000, 1), E.event_delete(1),
            E.note("warning", "x"), E.op(1, "aten::mm", reads=[(0, 0x100, 64, (4, (4, 4), (4, 1)))],
                                         writes=[(0, 0x200, 64)])]
    return evs


TEMPLATES = _templates()


def _mutate(ev, path, value):
    """ev with the item at ``path`` (indices into nested lists/tuples) replaced by value."""
    if not path or not isinstance(ev, (list, tuple)) or not ev:
        return value
    i = path[0] % len(ev)
    items = list(ev)
    items[i] = _mutate(items[i], path[1:], value)
    return type(ev)(items)


# values of every JSON / marshal type, to put where another type belongs
_OTHER_TYPE = st.sampled_from([None, "", "x", 0, -1, 1 << 40, 1 << 70, 1.5, float("nan"), b"x", (), [], (1,), [[1]],
                               {}, True, ("a", 1, "f"), (0, 1, 2)])


@st.composite
def wrong_events(draw):
    """A batch of mostly valid events with a few mutated (a field replaced, dropped or added) or random."""
    batch = list(S.prologue())
    for _ in range(draw(st.integers(1, 12))):
        ev = draw(st.sampled_from(TEMPLATES))
        how = draw(st.sampled_from(["keep", "field", "deep", "type", "deep-type", "drop", "add", "random", "kind"]))
        if how in ("field", "deep", "type", "deep-type"):
            path = draw(st.lists(st.integers(0, 7), min_size=1, max_size=1 if how in ("field", "type") else 4))
            ev = _mutate(ev, path, draw(_VALUE if how in ("field", "deep") else _OTHER_TYPE))
        elif how == "drop":
            ev = ev[:-1]
        elif how == "add":
            ev = ev + (draw(_VALUE),)
        elif how == "random":
            ev = draw(_VALUE)
        elif how == "kind":
            ev = (draw(st.integers(-3, 20)),) + ev[1:]
        batch.append(ev)
    if draw(st.booleans()):
        batch = [list(e) if isinstance(e, tuple) else e for e in batch]
    return batch


@FUZZ
@given(batch=wrong_events(), close=st.booleans(), fmt=st.sampled_from(FORMATS))
def test_fuzz_valid_marshal_with_wrong_event_shapes(work, batch, close, fmt):
    p = work / "shapes.sstrace"
    p.write_bytes(MAGIC + header_frame() + events_frame(batch) + (end_frame() if close else b""))
    check_trace(p, fmt)


@FUZZ
@given(payload=st.binary(max_size=256), compressed=st.booleans(), kind=st.sampled_from([b"E", b"M", b"Z", b"H", b"X"]))
def test_fuzz_valid_frames_with_garbage_payloads(work, payload, compressed, kind):
    body = zlib.compress(payload) if compressed else payload
    p = work / "garbage.sstrace"
    p.write_bytes(MAGIC + header_frame() + events_frame(S.pinned_d2h_then_h2d(1)) + frame(kind, body))
    check_trace(p)


@FUZZ
@given(payload=_VALUE)
def test_fuzz_event_frames_of_any_marshal_value(work, payload):
    p = work / "value.sstrace"
    p.write_bytes(MAGIC + header_frame() + events_frame(payload) + end_frame())
    check_trace(p)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=20)
_HEADER_KEYS = st.sampled_from(["format", "pid", "command", "environment", "created", "scope"])


@FUZZ
@given(header=_JSON | st.dictionaries(_HEADER_KEYS, _JSON, max_size=5), footer=_JSON, keep_format=st.booleans())
def test_fuzz_header_and_footer_json_of_the_wrong_shape(work, header, footer, keep_format):
    if keep_format and isinstance(header, dict):
        header["format"] = "streamsan.trace/1"
    p = work / "json.sstrace"
    p.write_bytes(MAGIC + header_frame(header) + events_frame(S.pinned_d2h_then_h2d(1)) + end_frame(footer))
    check_trace(p)


# ---------------------------------------------------------------- enormous traces
def _sparse(path, prefix: bytes, size: int):
    with open(path, "wb") as f:
        f.write(prefix)
        f.truncate(size)


def test_enormous_header_frame_fails_fast_with_one_line(capsys, tmp_path):
    p = tmp_path / "huge.sstrace"
    _sparse(p, MAGIC + struct.pack("<IIc", 1 << 31, 0, b"H"), (1 << 31) + 64)
    start = time.monotonic()
    code, out, err = cli("replay", p)
    assert time.monotonic() - start < 2
    assert code == exitcodes.USAGE and out == ""
    assert err == f"streamsan: error: {p}: trace header is missing or damaged\n"


def test_enormous_event_frame_is_not_read(tmp_path):
    """A frame claiming 2^31 bytes after good ones: the events before it are reported, fast, without
    reading (or allocating) the 2 GiB."""
    p = tmp_path / "huge.sstrace"
    good = MAGIC + header_frame() + events_frame(S.pinned_d2h_then_h2d(1))
    _sparse(p, good + struct.pack("<IIc", 1 << 31, 0, b"E"), (1 << 31) + len(good) + 64)
    start = time.monotonic()
    code, out, err = cli("replay", p, "--format", "json")
    assert time.monotonic() - start < 2
    assert code == 0 and err == ""
    rep = json.loads(out)
    n = len(S.pinned_d2h_then_h2d(1))
    assert rep["complete"] is False and rep["summary"]["events"] == n and len(rep["races"]) == 1
    assert rep["problems"] == [f"{p}: frame of {1 << 31} bytes is larger than the format allows after {n} events "
                               "(the events before it were analyzed)"]


def _zlib_bomb(inflated: int) -> bytes:
    """A zlib stream of ``inflated`` zero bytes, made fast: full flushes make every 1 MiB block the same bytes."""
    c = zlib.compressobj(9)
    chunk = b"\0" * (1 << 20)
    first = c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)
    return first + block * (inflated // len(chunk) - 1) + c.flush()


def test_a_zlib_bomb_frame_is_refused(tmp_path):
    """A checksummed 1 MB frame that would inflate to 1 GiB: damage, read no further than the format allows."""
    p = tmp_path / "bomb.sstrace"
    p.write_bytes(MAGIC + header_frame() + events_frame(S.pinned_d2h_then_h2d(1)) + frame(b"E", _zlib_bomb(1 << 30)))
    code, out, err = cli("replay", p, "--format", "json")
    assert code == 0 and err == ""
    rep = json.loads(out)
    n = len(S.pinned_d2h_then_h2d(1))
    assert rep["complete"] is False and rep["summary"]["events"] == n
    assert rep["problems"] == [f"{p}: event frame inflates to more than {MAX_FRAME} bytes after {n} events (the "
                               "events before it were analyzed)"]
    p.write_bytes(MAGIC + frame(b"H", _zlib_bomb(1 << 30)))
    assert cli("replay", p) == (exitcodes.USAGE, "", f"streamsan: error: {p}: trace header is damaged\n")


# ---------------------------------------------------------------- the report loader
@pytest.fixture(scope="module")
def good_report(work):
    p = work / "t.sstrace"
    p.write_bytes(valid_trace_bytes(work))
    rep = replay_trace(str(p))
    assert rep["races"]
    return rep


def check_report(path, fmt):
    with no_hang():
        try:
            rep = load_report(str(path))
        except ReportError as e:
            assert_one_line(e)
        else:
            VALIDATOR.validate(rep)  # what load_report accepts follows schema.json
    code, out, err = cli("show", path, "--format", fmt)
    assert "Traceback" not in out + err
    if code == exitcodes.USAGE:
        assert out == "" and err.startswith("streamsan: error: ") and err.count("\n") == 1, err
        assert err.endswith("\n")
    else:
        assert code in (exitcodes.OK, exitcodes.RACES) and err == "", (code, err)


@FUZZ
@given(data=st.binary(max_size=256), fmt=st.sampled_from(FORMATS))
def test_fuzz_random_bytes_as_report(work, data, fmt):
    p = work / "random.json"
    p.write_bytes(data)
    check_report(p, fmt)


@FUZZ
@given(value=_JSON, schema=st.sampled_from([None, "streamsan.report/1", "streamsan.report/2", 1, ""]),
       fmt=st.sampled_from(FORMATS))
def test_fuzz_json_of_the_wrong_shape_as_report(work, value, schema, fmt):
    if schema is not None and isinstance(value, dict):
        value["schema"] = schema
    p = work / "shape.json"
    p.write_text(json.dumps(value))
    check_report(p, fmt)


def _paths(x, prefix=()):
    """Every path into a JSON value."""
    yield prefix
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, prefix + (i,))


def _replace(x, path, value):
    if not path:
        return value
    x = dict(x) if isinstance(x, dict) else list(x)
    x[path[0]] = _replace(x[path[0]], path[1:], value)
    return x


def _delete(x, path):
    x = dict(x) if isinstance(x, dict) else list(x)
    if len(path) == 1:
        del x[path[0]]
    else:
        x[path[0]] = _delete(x[path[0]], path[1:])
    return x


@FUZZ
@given(st.data())
def test_fuzz_a_valid_report_with_one_value_changed(work, good_report, data):
    paths = list(_paths(good_report))[1:]
    path = data.draw(st.sampled_from(paths), label="path")
    if data.draw(st.booleans(), label="delete"):
        rep = _delete(good_report, path)
    else:
        rep = _replace(good_report, path, data.draw(_JSON, label="value"))
    p = work / "changed.json"
    p.write_text(json.dumps(rep))
    check_report(p, data.draw(st.sampled_from(FORMATS), label="format"))


@pytest.mark.parametrize("schema", ["streamsan.report/0", "streamsan.report/2", "streamsan.report", None, 1, []])
def test_show_a_report_of_another_schema_version(tmp_path, good_report, schema):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(dict(good_report, schema=schema)))
    code, out, err = cli("show", p)
    assert code == exitcodes.USAGE and out == ""
    assert err == (f"streamsan: error: {p}: report schema {schema!r} is not supported (this streamsan reads "
                   "streamsan.report/1)\n")


@pytest.mark.parametrize("kind", [b"E", b"M"])
def test_an_event_frame_claiming_a_huge_list_is_refused_fast(tmp_path, kind):
    """marshal would allocate the 2^31 - 1 items a 9-byte payload claims (16 GiB of address space, 5 s) before
    failing. (Not tried here: the same as a tuple, which marshal also fills in, taking 16 GiB of memory.)"""
    p = tmp_path / "big.sstrace"
    n = len(S.pinned_d2h_then_h2d(1))
    payload = b"[" + struct.pack("<i", (1 << 31) - 1) + b"N" * 4
    good = MAGIC + header_frame() + events_frame(S.pinned_d2h_then_h2d(1))
    p.write_bytes(good + frame(kind, zlib.compress(payload) if kind == b"E" else payload))
    start = time.monotonic()
    code, out, err = cli("replay", p, "--format", "json")
    assert time.monotonic() - start < 2
    assert code == 0 and err == ""
    assert json.loads(out)["problems"] == [f"{p}: undecodable event frame after {n} events (the events before it "
                                           "were analyzed)"]


def test_json_nested_too_deeply(tmp_path):
    """json raises RecursionError (not ValueError) on deep nesting: still one line, for a report and a trace."""
    r = tmp_path / "r.json"
    r.write_text("[" * 100_000)
    assert cli("show", r) == (exitcodes.USAGE, "", f"streamsan: error: {r}: not a streamsan report (JSON nested too "
                                                   "deeply)\n")
    t = tmp_path / "t.sstrace"
    t.write_bytes(MAGIC + frame(b"H", zlib.compress(b"[" * 100_000)))
    assert cli("replay", t) == (exitcodes.USAGE, "", f"streamsan: error: {t}: trace header is damaged\n")
    t.write_bytes(MAGIC + header_frame() + events_frame(S.pinned_d2h_then_h2d(1))
                  + frame(b"Z", zlib.compress(b"[" * 100_000)))
    code, out, err = cli("replay", t, "--format", "json")
    assert code == 0 and err == "" and json.loads(out)["complete"] is True  # the end mark is there; its extras are not


# ---------------------------------------------------------------- unwritable output, before anything runs
@pytest.mark.parametrize("where", ["under-a-file", "read-only-directory"])
@pytest.mark.parametrize("sub", ["replay", "wrap", "merge"])
def test_unwritable_output_fails_before_anything_runs(tmp_path, good_report, sub, where, monkeypatch):
    if where == "read-only-directory" and os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    monkeypatch.chdir(tmp_path)
    t = tmp_path / "t.sstrace"
    t.write_bytes(MAGIC + header_frame() + events_frame(S.pinned_d2h_then_h2d(1)) + end_frame())
    r = tmp_path / "r.json"
    r.write_text(json.dumps(good_report))
    (tmp_path / "file").write_text("")
    (tmp_path / "ro").mkdir(mode=0o500)
    out = {"under-a-file": tmp_path / "file" / "out.json", "read-only-directory": tmp_path / "ro" / "out.json"}[where]
    ran = tmp_path / "ran"

    def must_not_run(*a, **k):
        raise AssertionError("ran before checking the output")

    monkeypatch.setattr("streamsan.cli.replay_trace", must_not_run)
    monkeypatch.setattr("streamsan.cli.load_report", must_not_run)
    argv = {"replay": ["replay", t, "--report", out],
            "wrap": ["wrap", "--report", out, "--", "touch", ran],
            "merge": ["merge", r, "-o", out]}[sub]
    code, stdout, err = cli(*argv)
    reason = "permission denied" if where == "read-only-directory" else f"{out.parent} is not a directory"
    assert (code, stdout, err) == (exitcodes.USAGE, "", f"streamsan: error: cannot write {out}: {reason}\n")
    assert not ran.exists() and not out.exists()


def test_the_largest_agent_id_costs_little_and_a_larger_one_is_refused(tmp_path):
    """The analyzer's clocks grow with the square of the largest agent id: a trace naming agent 60000 once made
    it build billions of entries (found by the fuzzer above)."""
    from streamsan import events as E

    p = tmp_path / "agents.sstrace"
    p.write_bytes(MAGIC + header_frame() + events_frame([(E.EVENT_RECORD, 5, E.MAX_AGENT - 1, 0)]) + end_frame())
    start = time.monotonic()
    code, out, err = cli("replay", p, "--format", "json")
    assert time.monotonic() - start < 2
    assert code == 0 and json.loads(out)["complete"] is True
    p.write_bytes(MAGIC + header_frame() + events_frame([(E.EVENT_RECORD, 5, E.MAX_AGENT, 0)]) + end_frame())
    assert cli("replay", p, "--format", "json") == (
        2, "", f"streamsan: error: {p}: invalid event 0: EVENT_RECORD: agent ids are integers in [0, {E.MAX_AGENT})\n")
