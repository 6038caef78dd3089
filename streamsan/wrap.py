"""The parent side of ``streamsan wrap``: run a command so that every Python process in it is traced, then
turn the traces its processes left in the session directory into one report.

Each traced process writes ``*.sstrace`` into ``STREAMSAN_SESSION_DIR`` (see ``streamsan.session``); the
``_bootstrap`` directory put first on ``PYTHONPATH`` starts tracing in every Python process that inherits the
environment.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from .exitcodes import NOT_EXECUTABLE, NOT_FOUND
from .replay import replay_trace
from .report.environment import collect_environment
from .report.merge import merge_reports
from .status import analysis_progress
from .trace import TraceError

log = logging.getLogger("streamsan")

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


class CommandError(Exception):
    """The command could not be started; ``exit_code`` is 127 (not found) or 126 (cannot execute)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def child_env(session_dir: str, scope: str, base=None) -> dict:
    """The command's environment: ``base`` (default: ours) plus the session variables and the bootstrap
    directory first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env["STREAMSAN_SESSION_DIR"] = session_dir
    env["STREAMSAN_SCOPE"] = scope
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = BOOTSTRAP_DIR + (os.pathsep + rest if rest else "")
    return env


def _terminal_sends_sigint_to_child() -> bool:
    """Whether we are the terminal's foreground process group: then the child, run in our group, gets a Ctrl-C
    from the terminal itself, and must not get it twice."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def _own_process_group() -> None:
    """In the child, before exec: a process group of its own, so that a signal sent to our whole group (a CI
    cancelling a job: ``kill -INT -PGID``) reaches it once, through us; and on Linux SIGKILL when we die, so
    that killing our group does not leave it running."""
    os.setpgid(0, 0)
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_PR_SET_PDEATHSIG = 1
try:
    import ctypes

    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (ImportError, OSError, AttributeError):
    _prctl = None


@contextlib.contextmanager
def _forward_signals(proc, own_group: bool):
    def forward(signum, _frame):
        try:
            if own_group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)
        except ProcessLookupError:
            pass

    def ignore(_signum, _frame):
        pass  # (the terminal sent the child a Ctrl-C of its own)

    handlers = {signal.SIGINT: forward if own_group else ignore, signal.SIGTERM: forward}
    old = {s: signal.signal(s, h) for s, h in handlers.items()}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_command(cmd: list, env: dict) -> int:
    """Run cmd to completion, forwarding SIGINT and SIGTERM once; its return code (negative: killed by a
    signal). At a terminal's foreground the command runs in our process group (it gets the terminal's Ctrl-C and
    keeps the terminal); elsewhere in one of its own, which we pass the signals we get."""
    own_group = not _terminal_sends_sigint_to_child()
    try:
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_own_process_group if own_group else None)
    except FileNotFoundError:
        raise CommandError(f"{cmd[0]}: command not found", NOT_FOUND) from None
    except PermissionError:
        raise CommandError(f"{cmd[0]}: permission denied (not executable)", NOT_EXECUTABLE) from None
    except OSError as e:
        raise CommandError(f"{cmd[0]}: cannot execute ({e.strerror})", NOT_EXECUTABLE) from None
    with _forward_signals(proc, own_group):
        return proc.wait()


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _session_processes(session_dir: str) -> set:
    """The pids of the processes (but us) that run in the session: those with its trace file, and, on Linux,
    every process whose environment names its directory (one that has not started tracing yet included)."""
    pids = set()
    for path in glob.glob(os.path.join(session_dir, "trace-*.sstrace")):
        m = re.fullmatch(r"trace-(\d+)\.sstrace", os.path.basename(path))
        if m:
            pids.add(int(m.group(1)))
    marker = f"STREAMSAN_SESSION_DIR={session_dir}".encode()
    for entry in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(entry, "rb") as f:
                if marker in f.read().split(b"\0"):
                    pids.add(int(entry.split("/")[2]))
        except (OSError, ValueError):
            pass
    pids.discard(os.getpid())
    return pids


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except OSError:
        return ""


WRITERS_WAIT_S = 5.0


def wait_for_writers(session_dir: str, timeout: float | None = None) -> dict:
    """Give the processes of the session that outlived the command (multiprocessing's resource tracker, a
    worker finishing, a child started in the background) up to ``timeout`` seconds in all (default
    :data:`WRITERS_WAIT_S`) to exit. Returns those still running then: pid -> command line."""
    deadline = time.monotonic() + (WRITERS_WAIT_S if timeout is None else timeout)
    pids = _session_processes(session_dir)
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
        pids |= _session_processes(session_dir)
    running = {p: _command_line(p) for p in sorted(pids) if _alive(p)}
    for pid, command in running.items():
        log.debug("process %d (%s) still runs: its trace may be incomplete", pid, command)
    return running


def collect_report(session_dir: str, cmd: list, status=None, still_running=None) -> dict:
    """One report from every trace in the session directory (processes in pid order). A trace that cannot be
    read at all becomes a problem of the report, not an error. ``status``: a StatusLine to show progress on.
    ``still_running``: pid -> command line of the processes that had not exited (see :func:`wait_for_writers`):
    the report is incomplete, and says so for each."""
    still_running = still_running or {}
    reports, problems = [], []
    paths = sorted(glob.glob(os.path.join(session_dir, "*.sstrace")))
    found = 0
    for i, path in enumerate(paths, 1):
        name = os.path.basename(path)
        progress = analysis_progress(status, name, i, len(paths), found) if status is not None else None
        try:
            reports.append(replay_trace(path, with_process=True, name=name, progress=progress))
            found += len(reports[-1]["races"])
        except TraceError as e:
            problems.append(str(e).replace(session_dir + os.sep, ""))
    reports.sort(key=lambda r: r["processes"][0]["pid"] or 0)
    for r in reports:
        _mark_still_running(r, still_running)
    env = next((r["environment"] for r in reports if r["environment"]), None) or collect_environment()
    merged = merge_reports(reports, command=cmd, environment=env)
    if not reports and not problems and not still_running:
        problems.append("no process wrote a trace (the command ran no Python program, or tracing could not "
                        "start in it: see its stderr)")
    traced = {r["processes"][0]["pid"] for r in reports}
    problems += [f"process {pid} ({command or 'command unknown'}) was still running when wrap stopped waiting "
                 f"for it, before it wrote a trace" for pid, command in still_running.items() if pid not in traced]
    if problems:
        merged["complete"] = False
        merged["problems"].extend(problems)
    return merged


def _mark_still_running(report: dict, still_running: dict) -> None:
    """A process still running has a trace without its end mark: say why, rather than that it did not exit
    normally."""
    process = report["processes"][0]
    if process["pid"] not in still_running:
        return
    why = (f"{process['trace']}: process {process['pid']} was still running when wrap stopped waiting for it "
           f"(the events it wrote until then were analyzed)")
    problems = [p for p in report["problems"] if "has no end mark" not in p] + [why]
    report["problems"][:] = problems
    report["complete"] = process["complete"] = False
    process["problems"] = list(problems)


def exit_status(rc: int) -> dict:
    """How the wrapped command ended, for the report: ``{"code": N, "signal": None}`` or, when a signal killed
    it, ``{"code": 128 + N, "signal": "SIGKILL"}``."""
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return {"code": 128 - rc, "signal": name}
    return {"code": rc, "signal": None}


def keep_traces(session_dir: str, dest: str) -> list:
    """Move the session's traces to ``dest``: a file for one trace (unless dest is a directory), else a
    directory (created). Returns the new paths; raises OSError."""
    paths = sorted(glob.glob(os.path.join(session_dir, "*.sstrace")))
    if not paths:
        return []
    if len(paths) == 1 and not os.path.isdir(dest):
        shutil.move(paths[0], dest)
        return [dest]
    os.makedirs(dest, exist_ok=True)
    out = []
    for p in paths:
        out.append(os.path.join(dest, os.path.basename(p)))
        shutil.move(p, out[-1])
    return out
