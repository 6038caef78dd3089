"""Analysis in a helper process, so that a watched program pays for tracing only.

:class:`AnalysisHelper` starts a Python process in isolated mode that runs :func:`main` (streamsan's core
only: no torch, no CuPy, no tracing of its own) and sends it each batch of events through a pipe; the helper
runs the :class:`~streamsan.analysis.analyzer.Analyzer` on another core and, when asked, sends the analyzer back.
Once started, the helper writes one byte, ``+`` (ready). Frames on the pipe: one kind byte, a 4-byte
little-endian length, the payload. To the helper: ``B`` a marshalled batch, ``Q`` a query (reply: the pickled
analyzer and the helper's problems so far), ``E`` the end (the same reply, then the helper exits).

Nothing here may break the program: when the helper cannot start, :attr:`AnalysisHelper.problem` says so and
the session analyzes in its own process instead; when it dies, the problem says so in one line and the
session reports that its analysis is incomplete. A process forked from the watched one never writes to its
parent's helper.
"""

from __future__ import annotations

import marshal
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import weakref

_HEADER = struct.Struct("<cI")
# The helper is never far behind (writes block once the pipe is full), so an answer that takes this long
# means it is stuck: it is killed and the report says so.
REPLY_TIMEOUT = 120.0
PIPE_BYTES = 1 << 20
READY_TIMEOUT = 30.0  # seconds for the helper to start
_READY = b"+"
_helpers: weakref.WeakSet = weakref.WeakSet()


def _forget_helpers_after_fork() -> None:
    for h in list(_helpers):
        h._proc = None  # the child of a fork never talks to its parent's helper
        h._lock = threading.Lock()  # (a thread that held it at the fork does not exist in the child)


os.register_at_fork(after_in_child=_forget_helpers_after_fork)


class AnalysisHelper:
    """The parent's end: :meth:`feed` batches, :meth:`snapshot` / :meth:`finish` the analyzer."""

    def __init__(self):
        self.problem: str | None = None
        self._pid = os.getpid()
        self._proc = None
        self._lock = threading.Lock()  # one frame (and its reply) on the pipe at a time, whatever the thread
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        # Isolated mode: no PYTHONPATH (so no `streamsan wrap` bootstrap), no user site, no current directory.
        code = f"import sys; sys.path.insert(0, {root!r}); from streamsan.helper import main; sys.exit(main())"
        if os.name != "posix" or not sys.executable:
            self.problem = "the analysis helper needs POSIX pipes and a Python executable"
        else:
            try:
                # Unbuffered: nothing of the parent's may sit in a buffer that a forked child could flush.
                self._proc = subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, close_fds=True, bufsize=0)
                _widen_pipe(self._proc.stdin.fileno())
                # Wait until it is ready: else the program's first events fill the pipe while the helper starts,
                # and the program waits for it in the middle of its run.
                if _read(self._proc.stdout, 1, READY_TIMEOUT) != _READY:
                    raise ValueError("it did not say it was ready")
            except (OSError, ValueError, TimeoutError, EOFError) as e:
                self.problem = f"the analysis helper could not start ({e})"
                if self._proc is not None:
                    self._proc.kill()
                    self._reap()
        _helpers.add(self)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self.problem is None

    def _send(self, kind: bytes, payload: bytes = b"") -> bool:
        if not self.alive or os.getpid() != self._pid:
            return False
        try:
            data = memoryview(_HEADER.pack(kind, len(payload)) + payload)
            fd = self._proc.stdin.fileno()
            while data:
                data = data[os.write(fd, data):]
            return True
        except (OSError, ValueError) as e:
            self._died(e)
            return False

    def _died(self, why) -> None:
        code = self._proc.poll() if self._proc is not None else None
        detail = f"exit status {code}" if code is not None else f"{type(why).__name__}: {why}"
        self.problem = f"the analysis helper stopped ({detail}): events after that were not analyzed"

    def feed(self, batch) -> None:
        data = marshal.dumps(batch)
        with self._lock:
            self._send(b"B", data)

    def _receive(self):
        try:
            head = _read(self._proc.stdout, _HEADER.size, REPLY_TIMEOUT)
            _kind, n = _HEADER.unpack(head)
            return pickle.loads(_read(self._proc.stdout, n, REPLY_TIMEOUT))
        except Exception as e:
            self._died(e)
            self._proc.kill()
            return None

    def snapshot(self):
        """(analyzer, problems of the helper) as of every batch fed so far; (None, []) when it is gone."""
        with self._lock:
            reply = self._receive() if self._send(b"Q") else None
        return (None, []) if reply is None else reply

    def finish(self):
        """(analyzer, problems of the helper) at the end; the helper exits. (None, []) when it is gone."""
        with self._lock:
            reply = self._receive() if self._send(b"E") else None
            self._reap()
        return (None, []) if reply is None else reply

    def _reap(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _widen_pipe(fd: int) -> None:
    """Let the pipe hold many batches (Linux; 64 KiB by default, two batches), so that the program never waits
    for the helper while it analyzes a burst."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (ImportError, OSError):
        pass


def _read(stream, n: int, timeout: float | None = None) -> bytes:
    """Exactly n bytes from a pipe (an unbuffered one returns what has arrived so far); TimeoutError when
    nothing arrives for ``timeout`` seconds."""
    parts = []
    while n:
        if timeout is not None and not select.select([stream], [], [], timeout)[0]:
            raise TimeoutError(f"no answer in {timeout:g} s")
        chunk = stream.read(n)
        if not chunk:
            raise EOFError("the pipe closed")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def _reply(out, analyzer, problems) -> None:
    data = pickle.dumps((analyzer, problems), protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_HEADER.pack(b"R", len(data)))
    out.write(data)
    out.flush()


def main() -> int:
    """The helper's side: analyze batches until the end frame (or the parent's end of the pipe)."""
    import gc

    from .analysis.analyzer import Analyzer, feed_guarded

    gc.disable()  # the analyzer builds no garbage cycles; collection passes would triple its time
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    analyzer = Analyzer()
    problems: list[str] = []
    out.write(_READY)
    out.flush()
    while True:
        head = inp.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return 0  # the parent went away
        kind, n = _HEADER.unpack(head)
        payload = inp.read(n) if n else b""
        if kind == b"B":
            feed_guarded(analyzer, marshal.loads(payload), problems)
        elif kind == b"Q":
            _reply(out, analyzer, problems)
        elif kind == b"E":
            analyzer.finish()
            _reply(out, analyzer, problems)
            return 0


if __name__ == "__main__":
    sys.exit(main())
