"""Builds the native observer (``observer.cpp``) against the installed torch at first use, and loads it.

A build lives in ``$XDG_CACHE_HOME/streamsan/native/<key>/`` (else ``~/.cache/streamsan/native/<key>/``), the key
made of the torch version, the CPython ABI and the hash of the source and flags; a later process loads it from
there without compiling. A build is loaded only where its stamp names exactly this torch, ABI and source (the
headers it needs refuse the stable ABI: a build for another torch can abort the process). Any failure (no compiler,
a failed compile, an import error, a build for another torch) gives ``(None, reason)``, one line, never an
exception.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import io
import json
import os
import platform
import sys
import sysconfig
from pathlib import Path

SOURCE = Path(__file__).with_name("observer.cpp")
# the other files of the build, beside the main source: compiled with it (.cpp) or included by it (.h)
COMPANIONS = ("lane.cpp", "interpreter.h")
# NDEBUG as torch's own build has it: PyTorch's headers lay some structs out differently without it
# (RecordFunction's debug-only fields).
CFLAGS = ("-O2", "-DNDEBUG")
STAMP = "build.json"


def cache_root() -> Path:
    """Where builds are kept."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "streamsan" / "native"


def identity(source: bytes) -> dict:
    """What a build is for: this torch, this CPython ABI, this source and these flags."""
    import torch

    return {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", ""),
        "abi": sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag,
        "machine": platform.machine(),
        "source": hashlib.sha256(source + "\0".join(CFLAGS).encode()).hexdigest(),
    }


def build_key(ident: dict) -> str:
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    torch_version = "".join(c if c.isalnum() or c in ".-" else "_" for c in ident["torch"])
    return f"torch{torch_version}-{ident['abi']}-{digest}"


def load_extension(source: Path = SOURCE, root: Path | None = None, compile=None):
    """The observer's extension module and "" , or None and why not (one line)."""
    try:
        return _load(source, root, compile)
    except Exception as exc:  # whatever goes wrong, the program goes on without the observer
        return None, f"the native observer is off: {_one_line(exc)}"


def companions(source: Path) -> list[Path]:
    """The files built with ``source`` that are there beside it."""
    return [p for p in (Path(source).with_name(n) for n in COMPANIONS) if p.is_file()]


def _load(source, root, compile):
    text = Path(source).read_bytes() + b"".join(b"\0" + p.name.encode() + b"\0" + p.read_bytes()
                                                 for p in companions(source))
    ident = identity(text)
    key = build_key(ident)
    directory = (root if root is not None else cache_root()) / key
    name = "_streamsan_observer_" + key.rsplit("-", 1)[1]
    stamp = directory / STAMP
    built = _stamped(stamp, ident, name)
    if built is None:
        directory.mkdir(parents=True, exist_ok=True)
        sys.stderr.write(f"streamsan: building its native observer for torch {ident['torch']} (once; kept in "
                         f"{directory})\n")
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                built = _compile_with_fallback(name, Path(source), directory) if compile is None else \
                    compile(name, Path(source), directory)
        except Exception as exc:
            (directory / "build.log").write_text(log.getvalue() + f"\n{exc}\n")
            return None, f"the native observer did not build ({_one_line(exc)}; log: {directory / 'build.log'})"
        _write_stamp(stamp, dict(ident, module=name, file=os.path.basename(built)))
    module = _import(name, Path(built))
    import torch

    if not torch.__version__.startswith(getattr(module, "TORCH_VERSION", "?")):
        return None, f"the native observer was built for torch {module.TORCH_VERSION}, not {torch.__version__}"
    return module, ""


def _stamped(stamp: Path, ident: dict, name: str):
    """The built library a stamp vouches for, if it names this build exactly and the file is there; else None."""
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    if any(recorded.get(k) != v for k, v in ident.items()) or recorded.get("module") != name:
        return None
    path = stamp.parent / str(recorded.get("file", ""))
    return path if path.is_file() else None


def _write_stamp(stamp: Path, content: dict) -> None:
    tmp = stamp.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(content, indent=1, sort_keys=True))
    os.replace(tmp, stamp)


def _compile_with_fallback(name: str, source: Path, directory: Path) -> Path:
    """:func:`_compile`; where it fails, again without CPython's internal frame headers (call sites then need the
    GIL), so that a Python whose internal layout the source does not know still gets the observer."""
    try:
        return _compile(name, source, directory)
    except Exception as first:
        try:
            return _compile(name, source, directory, ("-DSTREAMSAN_PUBLIC_FRAMES_ONLY",))
        except Exception:
            raise first from None


def _compile(name: str, source: Path, directory: Path, extra: tuple = ()) -> Path:
    """Compile with torch's extension builder (which imports the module made); the path of its library."""
    from torch.utils import cpp_extension

    sources = [str(source)] + [str(p) for p in companions(source) if p.suffix == ".cpp"]
    sys.modules[name] = cpp_extension.load(name=name, sources=sources, build_directory=str(directory),
                                           extra_cflags=list(CFLAGS + extra), verbose=False, is_python_module=True)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = directory / (name + suffix)
        if path.is_file():
            return path
    raise RuntimeError(f"the build left no {name} library in {directory}")


def _import(name: str, path: Path):
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _one_line(exc: BaseException) -> str:
    """The line of an error that says what went wrong (a compiler's first ``error:``), shortened."""
    text = str(exc) or type(exc).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in [ln for ln in lines if "error:" in ln.lower()] + lines:
        text = ln
        break
    else:
        text = type(exc).__name__
    text = text.rstrip(".")
    return text if len(text) <= 200 else text[:197] + "..."
