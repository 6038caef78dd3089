"""Post-import hooks: run a function when a module has been imported, without importing it ourselves.

Used to attach the torch and CuPy tracers and the library hooks when the traced program imports those
libraries, so that ``streamsan wrap`` adds no import (and no start-up cost) the program would not have.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading

log = logging.getLogger("streamsan")

_waiting: dict[str, list] = {}
_lock = threading.Lock()


def _run(name: str, module) -> None:
    with _lock:
        fns = _waiting.pop(name, [])
    for fn in fns:
        try:
            fn(module)
        except Exception as e:  # a hook must never break the program's import
            log.warning("streamsan: hook for %s failed: %s", name, e)


class _Loader(importlib.abc.Loader):
    def __init__(self, name, loader):
        self.name = name
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _run(self.name, module)

    def __getattr__(self, item):
        return getattr(self.loader, item)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(fullname, spec.loader)
                return spec
        return None


_finder = _Finder()


def when_imported(name: str, fn) -> None:
    """Call ``fn(module)`` once module ``name`` is imported (now, if it already is)."""
    mod = sys.modules.get(name)
    if mod is not None and getattr(getattr(mod, "__spec__", None), "_initializing", False) is False:
        fn(mod)
        return
    with _lock:
        _waiting.setdefault(name, []).append(fn)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
