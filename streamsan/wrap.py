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
    """Whether we (and so the child, in our process group) are the terminal's foreground group: then a
    Ctrl-C reached the child already and must not be sent twice."""
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


@contextlib.contextmanager
def _forward_signals(proc):
    def forward(signum, _frame):
        if signum == signal.SIGINT and _terminal_sends_sigint_to_child():
            return
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_command(cmd: list, env: dict) -> int:
    """Run cmd to completion, forwarding SIGINT and SIGTERM; its return code (negative: killed by a signal)."""
    try:
        proc = subprocess.Popen(cmd, env=env)
    except FileNotFoundError:
        raise CommandError(f"{cmd[0]}: command not found", NOT_FOUND) from None
    except PermissionError:
        raise CommandError(f"{cmd[0]}: permission denied (not executable)", NOT_EXECUTABLE) from None
    except OSError as e:
        raise CommandError(f"{cmd[0]}: cannot execute ({e.strerror})", NOT_EXECUTABLE) from None
    with _forward_signals(proc):
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


def wait_for_writers(session_dir: str, timeout: float = 5.0) -> None:
    """Give processes that outlived the command and still write their trace (multiprocessing's resource
    tracker, a worker finishing) up to ``timeout`` seconds in all to exit."""
    deadline = time.monotonic() + timeout
    for path in glob.glob(os.path.join(session_dir, "trace-*.sstrace")):
        m = re.fullmatch(r"trace-(\d+)\.sstrace", os.path.basename(path))
        pid = int(m.group(1)) if m else 0
        while pid and pid != os.getpid() and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if pid and _alive(pid):
            log.debug("process %d still runs: its trace may be incomplete", pid)


def collect_report(session_dir: str, cmd: list, status=None) -> dict:
    """One report from every trace in the session directory (processes in pid order). A trace that cannot be
    read at all becomes a problem of the report, not an error. ``status``: a StatusLine to show progress on."""
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
    env = next((r["environment"] for r in reports if r["environment"]), None) or collect_environment(cmd)
    merged = merge_reports(reports, command=cmd, environment=dict(env, command=list(cmd)))
    if not reports and not problems:
        problems.append("no process wrote a trace (the command ran no Python program, or tracing could not "
                        "start in it: see its stderr)")
    if problems:
        merged["complete"] = False
        merged["problems"].extend(problems)
    return merged


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
