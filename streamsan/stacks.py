"""Cheap Python stack capture for tracers.

At access time a stack is a tuple of (code id, bytecode offset) pairs taken from the live frames (the innermost
one and the user frames outside it), interned to a small integer; the file / line / function triples are written
once per distinct stack as a ``DEF_STACK`` event.
Frames of streamsan itself are skipped. Code objects are kept alive by the table so their ids stay unique.
Frames are never retained (that would keep tensors alive and change the program's memory behaviour).
A function another library installed in torch's namespaces in place of torch's own (torch_geometric's
``torch.index_select``) is torch's API to its callers: its frames are plumbing, left out of the recorded stacks,
so that a finding stands at the line that called ``torch.index_select``, not in the wrapper every such call
shares.
"""

from __future__ import annotations

import os
import sys
import threading
from types import FunctionType

from . import events as E
from .analysis.locations import is_library_frame

_getframe = sys._getframe

_OWN_DIR = os.path.normcase(os.path.dirname(os.path.abspath(__file__))) + os.sep


OWN, LIBRARY, USER = 0, 1, 2


class _TorchApiWrappers:
    """The code objects of functions outside torch that are installed in torch's namespaces (``torch``,
    ``torch.Tensor``, ``torch.nn.functional``), and of the functions such a wrapper passes the call on to in place
    of torch's (a wrapper of a wrapper: its ``__wrapped__``, or the function it keeps under a name containing the
    API's, ``_old_index_select``). A library installs them when it is imported: they are looked up again when
    modules were imported since the last look (a function installed without an import is seen from the next one)."""

    NAMESPACES = ("torch", "torch.nn.functional", "torch.functional")

    def __init__(self):
        self.modules = -1
        self.codes: dict = {}  # id(code) -> the function it is the code of (kept: the id stays its own)
        self.lock = threading.Lock()

    def __contains__(self, code) -> bool:
        if len(sys.modules) != self.modules:
            with self.lock:
                modules = len(sys.modules)
                if modules != self.modules:
                    self.codes = {id(f.__code__): f for f in self._scan()}
                    self.modules = modules  # (after the scan: another thread meanwhile waits for it)
        fn = self.codes.get(id(code))
        return fn is not None and fn.__code__ is code

    def _scan(self):
        spaces = [vars(sys.modules[m]) for m in self.NAMESPACES if m in sys.modules]
        tensor = vars(sys.modules["torch"]).get("Tensor") if "torch" in sys.modules else None
        if isinstance(tensor, type):
            spaces.append(vars(tensor))
        for space in spaces:
            for name, value in list(space.items()):
                depth = 0
                while value.__class__ is FunctionType and depth < 4:  # (no attribute lookups on other objects:
                    code = value.__code__  # a module's __getattr__ may import)
                    if is_library_frame(code.co_filename) or is_own_file(code.co_filename):
                        break
                    yield value
                    value, depth = _passed_on_to(value, name), depth + 1


def _passed_on_to(fn, name: str):
    """The function a wrapper of torch's ``name`` hands its calls to, where it says: ``__wrapped__``, or a global
    or closure variable named after it (``_old_index_select``, ``orig_index_select``); else None."""
    inner = fn.__dict__.get("__wrapped__")
    if inner.__class__ is FunctionType:
        return inner
    code = fn.__code__
    word = f"_{name}_"
    for var in code.co_names:
        if var != name and word in f"_{var}_":
            inner = fn.__globals__.get(var)
            if inner.__class__ is FunctionType:
                return inner
    for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
        if word in f"_{var}_":
            try:
                inner = cell.cell_contents
            except ValueError:  # (an empty cell)
                continue
            if inner.__class__ is FunctionType:
                return inner
    return None


TORCH_API_WRAPPERS = _TorchApiWrappers()


def is_torch_api_wrapper(code) -> bool:
    """Whether a code object is a function another library put in torch's namespaces in place of torch's own."""
    return code in TORCH_API_WRAPPERS


def is_own_file(filename: str) -> bool:
    """Whether a source file is streamsan's own (the package, its hooks included)."""
    return os.path.normcase(filename).startswith(_OWN_DIR)


class StackTable:
    """Interns stacks; ``capture(events)`` returns a stack id, appending a DEF_STACK to ``events`` if new.

    A stack is identified by its innermost frame (the op's call site, often in a library such as torch) and the
    next ``key_users`` frames of user code outside it (library frames between them are walked, up to
    ``max_key`` frames, but not keyed). That key is cheap to build on every op; the first time a key is seen,
    the stack is recorded in more depth (up to ``depth`` frames with at least ``user_depth`` of user code) for
    reports. Calls that share the key but differ further out share that record; the innermost user frame,
    which findings are deduplicated on, is always part of the key.
    """

    def __init__(self, depth: int = 12, user_depth: int = 4, key_users: int = 2, max_key: int = 24):
        self.depth = depth
        self.user_depth = user_depth
        self.key_users = key_users
        self.max_key = max_key
        self.ids: dict[tuple, int] = {}
        self.codes: dict[int, object] = {}
        self.kinds: dict[int, int] = {}  # id(code) -> OWN, LIBRARY or USER
        self.wrappers: set[int] = set()  # ids of the torch API wrappers met (LIBRARY, left out of the frames)
        self.fallback = None  # called with the events when a thread has no frame outside streamsan (or 0)
        self.native = None  # outside() in C (set by the torch tracer where its C code is built)

    def classify(self, code) -> int:
        """Whether a code object is streamsan's own, a library's or the user's (OWN, LIBRARY, USER), remembered."""
        cid = id(code)
        self.codes[cid] = code
        k = OWN if is_own_file(code.co_filename) else LIBRARY if is_library_frame(code.co_filename) else USER
        if k == USER and is_torch_api_wrapper(code):
            k = LIBRARY
            self.wrappers.add(cid)
        self.kinds[cid] = k
        return k

    def capture(self, events: list, skip: int = 1) -> int:
        """Capture the caller's stack (innermost first), skipping ``skip`` frames and streamsan's own. In a thread
        without such frames (PyTorch's autograd engine runs CUDA backward ops in threads of its own), the stack
        is what ``fallback`` says, or 0."""
        try:
            f = _getframe(skip + 1)
        except ValueError:  # a shallower stack than the caller expects
            return self.no_frames(events)
        kind = self.kinds
        code = f.f_code
        k = kind.get(id(code))
        while not k:  # streamsan's own frames (0), or a code object not seen yet (None)
            if k is None:
                k = self.classify(code)
                if k:
                    break
            f = f.f_back
            if f is None:
                return self.no_frames(events)
            code = f.f_code
            k = kind.get(id(code))
        # the innermost frame (the op's call site), then the user frames outside it; library frames between
        # them are walked, not keyed (they are the same for the same user call sites)
        key = [id(code), f.f_lasti]  # f_lasti, the call site: cheaper than f_lineno (no line-table walk)
        users = self.key_users - (k == USER)
        walked = self.max_key
        while users > 0 and walked > 0:
            f = f.f_back
            if f is None:
                break
            code = f.f_code
            k = kind.get(id(code))
            if k is None:
                k = self.classify(code)
            if k == USER:
                key.append(id(code))
                key.append(f.f_lasti)
                users -= 1
            walked -= 1
        k = tuple(key)
        sid = self.ids.get(k)
        if sid is None:
            sid = self.define(events, k, _getframe(skip + 1))
        return sid

    def outside(self, events: list) -> int:
        """``capture`` for a caller inside streamsan: the stack from the nearest frame that is not streamsan's own
        (every frame skipped is streamsan's), in C where it is built."""
        native = self.native
        return native(events) if native is not None else self.capture(events, 1)

    def define(self, events: list, key: tuple, frame) -> int:
        """Intern a new stack key captured at ``frame`` (the caller of the op): its id, with its DEF_STACK
        appended to ``events``. (The C tracer's capture calls this too.)"""
        sid = self.ids[key] = len(self.ids) + 1
        events.append((E.DEF_STACK, sid, self._frames(frame)))
        return sid

    def no_frames(self, events: list) -> int:
        """The stack of a thread with no frame outside streamsan: what ``fallback`` says, or 0."""
        return self.fallback(events) if self.fallback is not None else 0

    def synthetic(self, events: list, key: tuple, frames: tuple) -> int:
        """The id of a stack made of given (file, line, function) frames, interned by ``key``."""
        sid = self.ids.get(key)
        if sid is None:
            sid = self.ids[key] = len(self.ids) + 1
            events.append((E.DEF_STACK, sid, frames))
        return sid

    def frames_here(self, skip: int = 1) -> tuple:
        """The caller's stack as report frames (streamsan's own left out)."""
        try:
            return self._frames(_getframe(skip + 1))
        except ValueError:
            return ()

    def _frames(self, f) -> tuple:
        """The stack from frame f outwards, for a report: ``depth`` frames, more until ``user_depth`` are user
        code (at most 64)."""
        kind = self.kinds
        frames = []
        users = 0
        while f is not None and len(frames) < 64:
            code = f.f_code
            k = kind.get(id(code))
            if k is None:
                k = self.classify(code)
            if k and id(code) not in self.wrappers:
                frames.append((code.co_filename, f.f_lineno, getattr(code, "co_qualname", code.co_name)))
                users += k == USER
                if len(frames) >= self.depth and users >= self.user_depth:
                    break
            f = f.f_back
        return tuple(frames)
