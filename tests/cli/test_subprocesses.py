"""Children of a wrapped program, traced through the real bootstrap (no GPU: they feed hand-made events to their
session): a subprocess, multiprocessing spawn and fork children (and the spawn method's resource tracker),
DataLoader workers. Each leaves its own trace and ``processes`` entry; ``wrap`` and ``streamsan merge``
deduplicate the findings by fingerprint."""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from tests.support.paths import ROOT


PROGRAM = textwrap.dedent(f"""
    import json, multiprocessing, os, subprocess, sys
    sys.path.insert(0, {str(ROOT)!r})

    def race():
        from tests.support import report_scenarios as S
        import streamsan.session
        streamsan.session.current().buffer.events.extend(S.pinned_d2h_then_h2d())

    if __name__ == "__main__":
        if sys.argv[1:] == ["child"]:
            race()
            print(os.getpid())
            sys.exit(0)
        race()
        pids = {{"parent": os.getpid()}}
        done = subprocess.run([sys.executable, __file__, "child"], capture_output=True, text=True, check=True)
        pids["subprocess"] = int(done.stdout)
        for method in ("spawn", "fork"):
            p = multiprocessing.get_context(method).Process(target=race)
            p.start()
            p.join()
            assert p.exitcode == 0, (method, p.exitcode)
            pids[method] = p.pid
        with open("pids.json", "w") as f:
            json.dump(pids, f)
""")

DATALOADER = textwrap.dedent("""
    import json, os
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Pids(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return os.getpid()

    if __name__ == "__main__":
        loader = DataLoader(Pids(), batch_size=1, num_workers=2, multiprocessing_context="fork")
        workers = sorted({int(b) for b in loader})
        with open("pids.json", "w") as f:
            json.dump({"parent": os.getpid(), "workers": workers}, f)
""")


def wrap(tmp_path, program: str, *args) -> subprocess.CompletedProcess:
    (tmp_path / "prog.py").write_text(program)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSAN_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "streamsan", "wrap", *args, "--", sys.executable, "prog.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """The wrapped program above: (its directory, the wrap's result, the children's pids, the report)."""
    d = tmp_path_factory.mktemp("family")
    done = wrap(d, PROGRAM, "--trace", "traces")
    pids = json.loads((d / "pids.json").read_text())
    return d, done, pids, json.loads((d / "streamsan-report.json").read_text())


def test_every_child_leaves_its_own_trace(family):
    d, done, pids, _ = family
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-1] == "streamsan: traces kept in " + ", ".join(
        sorted(f"traces/{os.path.basename(p)}" for p in glob.glob(str(d / "traces" / "*.sstrace"))))
    kept = sorted(os.path.basename(p) for p in glob.glob(str(d / "traces" / "*.sstrace")))
    mine = sorted(f"trace-{pid}.sstrace" for pid in pids.values())
    (tracker,) = set(kept) - set(mine)  # spawn's resource tracker is a Python process too
    assert sorted(mine + [tracker]) == kept


def test_wrapped_processes_write_uncompressed_event_frames(family):
    """A trace under wrap is read once, by the wrapping process: its processes skip compression (M frames)."""
    import struct

    from streamsan.trace import MAGIC, TraceReader

    d, _, pids, _ = family
    path = d / "traces" / f"trace-{pids['parent']}.sstrace"
    data = path.read_bytes()
    kinds, at = [], len(MAGIC)
    while at < len(data):
        length, _crc, kind = struct.unpack_from("<IIc", data, at)
        kinds.append(kind)
        at += 9 + length
    assert kinds[0] == b"H" and kinds[-1] == b"Z" and set(kinds[1:-1]) == {b"M"}
    r = TraceReader(str(path))
    assert sum(len(b) for b in r.batches()) == r.footer["events"] > 0 and r.complete


def test_each_process_appears_in_the_merged_report(family):
    d, _, pids, rep = family
    by_pid = {p["pid"]: p for p in rep["processes"]}
    assert set(pids.values()) < set(by_pid) and len(by_pid) == 5
    for name, pid in pids.items():
        p = by_pid[pid]
        assert (p["trace"], p["complete"], p["races"], p["occurrences"]) == (f"trace-{pid}.sstrace", True, 1, 1), name
    assert by_pid[pids["subprocess"]]["command"] == [sys.executable, str(d / "prog.py"), "child"]  # __file__
    # (the command wrap ran: said once, as the report's own)
    assert rep["command"] == [sys.executable, "prog.py"]
    assert "command" not in by_pid[pids["fork"]] and "command" not in by_pid[pids["parent"]]
    spawn = by_pid[pids["spawn"]]["command"]
    code = spawn[spawn.index("-c") + 1]  # after the interpreter's own flags, if any
    assert spawn[0] == sys.executable and code.startswith("from multiprocessing.spawn import spawn_main")
    (tracker,) = [p for pid, p in by_pid.items() if pid not in pids.values()]
    code = tracker["command"][tracker["command"].index("-c") + 1]
    assert code.startswith("from multiprocessing.resource_tracker import main") and tracker["races"] == 0
    # one finding, deduplicated by fingerprint across the four processes that hit it
    assert [(r["kind"], r["count"]) for r in rep["races"]] == [("device-device", 4)]
    assert rep["complete"] is True and rep["summary"]["processes"] == 5


def test_streamsan_merge_deduplicates_per_process_reports(family, tmp_path):
    d, _, _, wrapped = family
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    reports = []
    for i, trace in enumerate(sorted(glob.glob(str(d / "traces" / "*.sstrace")))):
        reports.append(str(tmp_path / f"r{i}.json"))
        done = subprocess.run([sys.executable, "-m", "streamsan", "replay", trace, "--report", reports[-1]],
                              env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    out = tmp_path / "merged.json"
    done = subprocess.run([sys.executable, "-m", "streamsan", "merge", *reports, "-o", str(out)], env=env,
                          capture_output=True, text=True)
    assert done.stderr == f"streamsan: merged 5 reports (1 race) into {out}\n"
    merged = json.loads(out.read_text())
    assert [(r["kind"], r["count"], r["fingerprint"]) for r in merged["races"]] == [
        (r["kind"], r["count"], r["fingerprint"]) for r in wrapped["races"]]
    assert len(merged["processes"]) == 5 and merged["summary"]["occurrences"] == 4


def test_dataloader_workers_are_traced(tmp_path):
    pytest.importorskip("torch")
    done = wrap(tmp_path, DATALOADER)
    assert done.returncode == 0, done.stderr
    pids = json.loads((tmp_path / "pids.json").read_text())
    rep = json.loads((tmp_path / "streamsan-report.json").read_text())
    assert len(pids["workers"]) == 2
    assert sorted(p["pid"] for p in rep["processes"]) == sorted([pids["parent"], *pids["workers"]])
    assert all(p["complete"] for p in rep["processes"]) and rep["races"] == []
    assert rep["notes"] == [{"level": "warning", "text": "no CUDA device is available: nothing could be checked "
                                                         "(the program ran unchanged)"}]


def test_wrap_waits_for_processes_that_still_write_their_trace(tmp_path):
    from streamsan.wrap import wait_for_writers

    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    (tmp_path / f"trace-{quick.pid}.sstrace").write_bytes(b"")
    start = time.monotonic()
    wait_for_writers(str(tmp_path), timeout=30)
    waited = time.monotonic() - start
    assert quick.poll() == 0  # it exited (a zombie until now: exited counts as done)
    assert 0.3 < waited < 20
    os.remove(tmp_path / f"trace-{quick.pid}.sstrace")
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f"trace-{slow.pid}.sstrace").write_bytes(b"")
        start = time.monotonic()
        wait_for_writers(str(tmp_path), timeout=0.3)
        assert 0.3 <= time.monotonic() - start < 10 and slow.poll() is None  # gave up, left it running
    finally:
        slow.kill()
        slow.wait()


TORCHRUN = textwrap.dedent(f"""
    import json, os, sys
    import torch.distributed as dist
    sys.path.insert(0, {str(ROOT)!r})
    from tests.support import report_scenarios as S
    import streamsan.session

    dist.init_process_group("gloo")
    streamsan.session.current().buffer.events.extend(S.pinned_d2h_then_h2d())
    with open(f"pid-{{dist.get_rank()}}.json", "w") as f:
        json.dump(os.getpid(), f)
    dist.barrier()
    dist.destroy_process_group()
""")


def test_torchrun_workers_are_traced_and_merged(tmp_path):
    torch = pytest.importorskip("torch")
    launcher = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not torch.distributed.is_available() or not os.path.exists(launcher):
        pytest.skip("needs torch.distributed and its torchrun script")
    (tmp_path / "prog.py").write_text(TORCHRUN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSAN_")}
    env["PYTHONPATH"] = str(ROOT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "streamsan", "wrap", "--", launcher, "--nproc_per_node", "2",
                           "--master_port", str(port), "prog.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    workers = sorted(json.loads((tmp_path / f"pid-{r}.json").read_text()) for r in range(2))
    rep = json.loads((tmp_path / "streamsan-report.json").read_text())
    by_pid = {p["pid"]: p for p in rep["processes"]}
    assert len(by_pid) == 3 and set(workers) < set(by_pid)  # the launcher and its two workers
    assert [by_pid[w]["races"] for w in workers] == [1, 1]
    assert [(r["kind"], r["count"]) for r in rep["races"]] == [("device-device", 2)]
    assert rep["complete"] is True
