"""Programs written for streamsan's evaluation by authors who had not read streamsan: each pair is a stream bug
modelled on a real project (vLLM, SGLang, DeepSpeed, Megatron-LM, torchrec, diffusers, timm, PyG, CuPy...) and
its fix (``programs/<area>/<name>_bug.py`` / ``_fixed.py``; each file's header names its source). They run
unchanged, as ``streamsan wrap python prog.py`` would run them (here in this process, under ``watch()``).

``programs/expected.json`` holds each program's findings, (kind, previous stream, previous op, current stream,
current op), in any order; streams are named after the line that made them (``self.copy_stream``; the ``#2``
that tells apart streams made on one line is left out, as the order threads make them in varies). Every fixed
program is clean but one (``"_notes"``, which also says where streamsan's findings differ from what a program's
author expected). For programs whose threads race each other (``"_varies"``), each finding must be one of those
listed, and a bug program must give at least one.
"""

import json
import os
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
EXPECTED = json.loads((HERE / "expected.json").read_text())
NOTES = EXPECTED.pop("_notes")
VARIES = EXPECTED.pop("_varies")
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


def needs(path: Path) -> None:
    if "import cupy" in path.read_text():
        cupy = pytest.importorskip("cupy")
        if not cupy.cuda.is_available():
            pytest.skip("needs CuPy with a CUDA GPU")


def test_every_program_has_an_expectation():
    assert sorted(program_name(p) for p in program_paths()) == sorted(EXPECTED)


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
    session, got = san(run_program, path)
    assert session.complete, session.problems
    got = sorted((without_ordinal(f) for f in got), key=lambda f: [str(x) for x in f])  # (a role may be None)
    if name in VARIES:
        assert all(f in EXPECTED[name] for f in got)
        assert got or name.endswith("_fixed")
    else:
        assert got == EXPECTED[name]
