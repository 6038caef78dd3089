"""Programs written for streamsan's evaluation by authors who had not read streamsan: each pair is a stream bug
modelled on a real project (vLLM, SGLang, DeepSpeed, Megatron-LM, torchrec, diffusers, timm, PyG, CuPy...) and
its fix (``programs/<area>/<name>_bug.py`` / ``_fixed.py``; each file's header names its source). They run
unchanged, as ``streamsan wrap python prog.py`` would run them (here in this process, under ``watch()``).

``programs/expected.json`` holds each program's findings, (kind, previous stream, previous op, current stream,
current op), in any order; streams are named after the line that made them (``self.copy_stream``; the ``#2``
that tells apart streams made on one line is left out, as the order threads make them in varies). Every fixed
program is clean but one (``"_notes"``, which also says where streamsan's findings differ from what a program's
author expected). For programs whose threads race each other (``"_varies"``), each finding must be one of those
listed, and a bug program must give at least one (but those of ``"_may_miss"``, whose thread timing can hide
the race from streamsan's model: each says when). A bug program whose race, when it shows, makes a kernel read
garbage as indices (a device-side assert, which poisons the process's CUDA context) runs in a process of its own
(``"_may_poison"``): its findings are those of the session its crash ended.
"""

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
EXPECTED = json.loads((HERE / "expected.json").read_text())
NOTES = EXPECTED.pop("_notes")
VARIES = EXPECTED.pop("_varies")
MAY_POISON = EXPECTED.pop("_may_poison")
MAY_MISS = EXPECTED.pop("_may_miss")
ROOT = HERE.parents[2]
KNOWN_FALSE = {"paged_kv-hicache_write_indices_record_stream_fixed"}  # (a false report: see NOTES)


def program_paths():
    return sorted(HERE.glob("*/*.py"))


def program_name(path: Path) -> str:
    return f"{path.parent.name}-{path.stem}"


def run_program(path: Path) -> None:
    """Run a program file as ``python path`` would (its directory current, ``__name__ == "__main__"``), and put
    back the process-wide settings a program may leave changed."""
    cwd, argv = os.getcwd(), sys.argv
    os.chdir(path.parent)
    sys.argv = [str(path)]
    try:
        runpy.run_path(str(path), run_name="__main__")
    finally:
        os.chdir(cwd)
        sys.argv = argv
        cupy = sys.modules.get("cupy")
        if cupy is not None:  # (a program may hand CuPy's allocations to PyTorch's allocator): CuPy's default
            cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
        torch.cuda.set_stream(torch.cuda.default_stream())  # (a program may leave another stream current)
        torch.cuda.synchronize()


# Runs one program under watch() in a process of its own; prints the session's summary as JSON.
_ALONE = r"""
import json, os, runpy, sys
sys.path.insert(0, sys.argv[1])
import torch
import streamsan
from tests.gpu.support.scenario_kit import summarize
path = sys.argv[2]
os.chdir(os.path.dirname(path))
sys.argv = [path]
crash = None
with streamsan.watch() as s:
    try:
        runpy.run_path(path, run_name="__main__")
        torch.cuda.synchronize()
    except Exception as exc:
        if "device-side assert" not in str(exc):
            raise
        crash = str(exc).splitlines()[0]
print(json.dumps({"complete": s.complete, "problems": s.problems, "findings": summarize(s), "crash": crash}))
"""


def run_alone(path: Path):
    """(complete, problems, findings) of a program run under watch() in a process of its own."""
    done = subprocess.run([sys.executable, "-c", _ALONE, str(ROOT), str(path)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["complete"], out["problems"], [tuple(f) for f in out["findings"]]


def needs(path: Path) -> None:
    if "import cupy" in path.read_text():
        cupy = pytest.importorskip("cupy")
        if not cupy.cuda.is_available():
            pytest.skip("needs CuPy with a CUDA GPU")


def test_every_program_has_an_expectation():
    assert sorted(program_name(p) for p in program_paths()) == sorted(EXPECTED)
    assert set(MAY_POISON) <= set(EXPECTED) and all(n.endswith("_bug") for n in MAY_POISON)
    assert set(MAY_MISS) <= set(VARIES)


def without_ordinal(finding) -> list:
    kind, prev, prev_op, cur, cur_op = finding
    return [kind, _role(prev), prev_op, _role(cur), cur_op]


def _role(name):
    """A stream's role without its ordinal; None for a stream without a name (in a report; "" in a session)."""
    return re.sub(r"#\d+$", "", name) if name else None


def test_every_fixed_program_is_expected_clean_but_the_known_false_report():
    assert sorted(n for n, v in EXPECTED.items() if n.endswith("_fixed") and v) == sorted(KNOWN_FALSE)
    assert KNOWN_FALSE <= set(NOTES) and set(VARIES) <= set(EXPECTED)


@pytest.mark.parametrize("path", program_paths(), ids=program_name)
def test_program(san, path):
    needs(path)
    name = program_name(path)
    if name in MAY_POISON:
        complete, problems, got = run_alone(path)
        assert complete, problems
    else:
        session, got = san(run_program, path)
        assert session.complete, session.problems
    got = sorted((without_ordinal(f) for f in got), key=lambda f: [str(x) for x in f])  # (a role may be None)
    if name in VARIES:
        assert all(f in EXPECTED[name] for f in got)
        assert got or name.endswith("_fixed") or name in MAY_MISS
    else:
        assert got == EXPECTED[name]
