"""``streamsan.cupy_access``: which arguments of a raw CUDA kernel it reads and writes (docs/cupy.md).

A raw kernel does not say what it writes, so every array (and ``MemoryPointer``) argument of a launch is
read-and-write unless declared here. Declarations are kept in :data:`ACCESSES` under the kernel's key (its source
and name, or the identity of a jit kernel's function or of an untraced ``Function``), whether or not a session is
active, and apply to every later launch of the kernel.
"""

from __future__ import annotations

import re

ACCESSES: dict = {}  # kernel key -> Access
_kept_alive: list = []  # kernels declared by identity (kept alive so that their ids stay unique)


class Access:
    """A kernel's declared argument positions: ``reads`` (read only), ``writes`` and ``ignore`` (not accessed),
    as frozensets; a position in none of them is read-and-write."""

    __slots__ = ("reads", "writes", "ignore")

    def __init__(self, reads, writes, ignore):
        self.reads = reads
        self.writes = writes
        self.ignore = ignore


def cupy_access(kernel, reads=(), writes=(), ignore=(), *, name=None):
    """Declare which arguments of a raw CUDA kernel it reads and writes (returns ``kernel``).

    ``kernel``: a ``cupy.RawKernel``, a function from ``RawModule.get_function`` (or the ``RawModule`` itself with
    ``name=`` the kernel's name), or a ``cupyx.jit.rawkernel``. ``reads`` / ``writes`` / ``ignore``: argument
    positions (ints, as in the ``args`` tuple of the launch) or parameter names (strs, from the kernel's CUDA
    signature, or the Python signature of a jit kernel). Array arguments not listed stay read-and-write;
    ``ignore`` lists array arguments the kernel does not access at all. Works whether or not a session is active.
    """
    key, names = _kernel_key(kernel, name)
    if key is None:
        raise TypeError(f"cupy_access: not a CuPy raw kernel: {type(kernel).__name__}")

    def positions(items, what):
        if isinstance(items, (str, int)):
            items = (items,)
        out = set()
        for it in items:
            if isinstance(it, bool) or not isinstance(it, (int, str)):
                raise TypeError(f"cupy_access: {what} entries are argument positions or parameter names")
            if isinstance(it, int):
                if it < 0:
                    raise ValueError(f"cupy_access: negative argument position {it}")
                out.add(it)
                continue
            if names is None:
                raise ValueError(f"cupy_access: cannot read the parameter names of this kernel; give positions "
                                 f"instead of {it!r}")
            if it not in names:
                raise ValueError(f"cupy_access: the kernel has no parameter {it!r} (parameters: {names})")
            out.add(names.index(it))
        return frozenset(out)

    r, w, i = positions(reads, "reads"), positions(writes, "writes"), positions(ignore, "ignore")
    ACCESSES[key] = Access(r - w - i, w - i, i)
    return kernel


def _kernel_key(kernel, name=None):
    """(key, parameter names or None) of a raw kernel object."""
    key = getattr(kernel, "_streamsan_key", None)
    if key is not None:
        return key, getattr(kernel, "_streamsan_names", None)
    func = getattr(kernel, "_func", None)
    if func is not None and hasattr(kernel, "_mode"):  # cupyx.jit.rawkernel
        return ("jit", id(func)), _python_parameter_names(func)
    code = getattr(kernel, "code", None)
    if name is not None:  # a RawModule and a kernel name
        src = code if code is not None else getattr(kernel, "file_path", None)
        return ("mod", src, name), cuda_parameter_names(code, name) if code else None
    kname = getattr(kernel, "name", None)
    if isinstance(code, str) and isinstance(kname, str):  # RawKernel
        return ("raw", code, kname), cuda_parameter_names(code, kname)
    if type(kernel).__name__ == "Function" and hasattr(kernel, "ptr"):  # a Function from an untraced RawModule
        _kept_alive.append(kernel)
        return ("fn", id(kernel)), None
    return None, None


def _python_parameter_names(func):
    try:
        import inspect

        return list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None


def cuda_parameter_names(code, name):
    """Parameter names of ``__global__ ... name(...)`` in CUDA source, or None if it cannot be found."""
    if not isinstance(code, str):
        return None
    base = name.split("<")[0].strip().split("::")[-1]
    for m in re.finditer(r"__global__[^;{}]*?\b" + re.escape(base) + r"\s*(?:<[^(]*>)?\s*\(", code):
        i = j = m.end()
        depth = 1
        while j < len(code) and depth:
            c = code[j]
            depth += c == "("
            depth -= c == ")"
            j += 1
        if depth:
            return None
        params = [p.strip() for p in _split_top_level(code[i:j - 1])]
        if params in ([""], ["void"]):
            return []
        names = []
        for p in params:
            p = p.split("=")[0]
            p = re.sub(r"\[[^\]]*\]", "", p).strip()
            mm = re.search(r"([A-Za-z_]\w*)\s*$", p)
            if mm is None:
                return None
            names.append(mm.group(1))
        return names
    return None


def _split_top_level(s):
    """``s`` split at the commas outside brackets."""
    out, depth, cur = [], 0, []
    for c in s:
        if c in "(<[":
            depth += 1
        elif c in ")>]":
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    out.append("".join(cur))
    return out
