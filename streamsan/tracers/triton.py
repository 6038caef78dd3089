"""Triton kernels launched from Python (``kernel[grid](...)``): which of a kernel's arguments it writes, read from
its source.

A kernel writes the pointer arguments that reach its stores: ``tl.store`` / ``tl.atomic_*`` (their pointer
argument), ``store`` of a tensor descriptor or block pointer, and the stores of the ``@triton.jit`` functions it
calls with them. An argument reaches a store through any chain of assignments (``ptrs = out_ptr + offs``,
``bp = tl.make_block_ptr(base=out_ptr, ...)``, ``out_ptr += pid * stride``); values loaded from memory
(``tl.load(idx_ptr + i)``) are not pointers into the arguments they were loaded from. Every other argument is only
read. The torch tracer turns a launch into one op on the stream Triton launches on (the current one).
"""

from __future__ import annotations

import ast
import textwrap

STORES = frozenset({"store", "atomic_add", "atomic_and", "atomic_cas", "atomic_max", "atomic_min", "atomic_or",
                    "atomic_xchg", "atomic_xor"})
MAX_DEPTH = 4  # nested @triton.jit calls followed


def written_params(kernel, _depth: int = 0) -> frozenset | None:
    """The names of a ``triton.JITFunction``'s parameters its stores reach, or None when its source cannot be read
    or parsed."""
    try:
        tree = ast.parse(textwrap.dedent(kernel.src))
    except (AttributeError, OSError, SyntaxError, TypeError, ValueError):
        return None
    fdef = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if fdef is None:
        return None
    params = [a.arg for a in fdef.args.posonlyargs + fdef.args.args + fdef.args.kwonlyargs]
    origin = _origins(fdef, params)

    def reach(expr) -> set:
        out: set = set()
        for name in _pointer_names(expr):
            out |= origin.get(name, set())
        return out

    written: set = set()
    for node in ast.walk(fdef):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        callee = _jit_callee(kernel, func)
        store = (isinstance(func, ast.Attribute) and func.attr in STORES) or \
            (isinstance(func, ast.Name) and func.id in STORES and callee is None)  # from triton.language import store
        if store:
            if isinstance(func, ast.Attribute):
                written |= reach(func.value)  # a descriptor's or block pointer's own store
            ptr = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "pointer"), None)
            if ptr is not None:
                written |= reach(ptr)
            continue
        if callee is None or _depth >= MAX_DEPTH:
            continue
        inner = written_params(callee, _depth + 1)
        names = list(getattr(callee, "arg_names", ()))
        for i, arg in enumerate(node.args):
            if inner is None or (i < len(names) and names[i] in inner):
                written |= reach(arg)
        for kw in node.keywords:
            if inner is None or kw.arg in inner:
                written |= reach(kw.value)
    return frozenset(written & set(params))


def _origins(fdef, params) -> dict:
    """name -> the parameters its value may point into, to a fixed point over the function's assignments."""
    edges = []
    for node in ast.walk(fdef):
        if isinstance(node, ast.Assign):
            srcs = _pointer_names(node.value)
            edges += [(t, srcs) for target in node.targets for t in _target_names(target)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            srcs = _pointer_names(node.value) | (_target_names(node.target) if isinstance(node, ast.AugAssign)
                                                 else set())
            edges += [(t, srcs) for t in _target_names(node.target)]
        elif isinstance(node, ast.NamedExpr):
            edges.append((node.target.id, _pointer_names(node.value)))
        elif isinstance(node, ast.For):
            edges += [(t, _pointer_names(node.iter)) for t in _target_names(node.target)]
    origin = {p: {p} for p in params}
    changed = True
    while changed:
        changed = False
        for target, srcs in edges:
            got = set()
            for s in srcs:
                got |= origin.get(s, set())
            have = origin.setdefault(target, set())
            if not got <= have:
                have |= got
                changed = True
    return origin


def _pointer_names(expr) -> set:
    """Names an expression's value may be a pointer from: every name in it, except inside loads."""
    out: set = set()
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
            continue
        if isinstance(node, ast.Name):
            out.add(node.id)
        stack.extend(ast.iter_child_nodes(node))
    return out


def _target_names(target) -> set:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        out: set = set()
        for elt in target.elts:
            out |= _target_names(elt)
        return out
    return set()


def _jit_callee(kernel, func):
    """The ``@triton.jit`` function a call names (``helper(...)`` or ``module.helper(...)``), or None."""
    scope = getattr(kernel, "__globals__", None) or {}
    if isinstance(func, ast.Name):
        obj = scope.get(func.id)
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        obj = getattr(scope.get(func.value.id), func.attr, None)
    else:
        return None
    return obj if hasattr(obj, "src") and hasattr(obj, "arg_names") else None


_analyses: dict = {}  # id(kernel) -> (kernel, its written parameters): the kernel is kept, so its id stays its own


def kernel_writes(kernel) -> frozenset | None:
    """:func:`written_params` of a kernel, analyzed once."""
    got = _analyses.get(id(kernel))
    if got is None:
        got = _analyses[id(kernel)] = (kernel, written_params(kernel))
    return got[1]
