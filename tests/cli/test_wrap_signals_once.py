"""Without a terminal, a signal sent to wrap's whole process group (a CI cancelling a job: ``kill -INT
-PGID``) reaches the wrapped command once: it runs in a process group of its own, and wrap passes it what it
gets. A signal sent to wrap alone is passed on too (``test_wrap``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from tests.support.paths import ROOT


COUNTER = textwrap.dedent("""
    import os, signal, time
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)  # one byte per delivery (Python may run a handler once for two)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    print("ready", flush=True)
    time.sleep(3)
    got = os.read(r, 100)
    open("got.txt", "w").write(" ".join(signal.Signals(b).name for b in got))
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_whole_group_reaches_the_command_once(tmp_path, sig):
    (tmp_path / "counter.py").write_text(COUNTER)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "streamsan", "wrap", "--", sys.executable, "-S", "counter.py"],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # wrap leads its own group, without a terminal
    try:
        assert p.stdout.readline() == "ready\n"
        time.sleep(0.3)
        os.killpg(p.pid, sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert (tmp_path / "got.txt").read_text() == sig.name


def test_the_command_runs_in_a_group_of_its_own_without_a_terminal(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    prog = "import os; print(os.getpgrp() == os.getpid(), os.getpgrp() != os.getppid())"
    p = subprocess.run([sys.executable, "-m", "streamsan", "wrap", "--", sys.executable, "-S", "-c", prog],
                       cwd=tmp_path, env=env, capture_output=True, text=True, start_new_session=True, timeout=60)
    assert p.returncode == 0 and p.stdout == "True True\n", p.stderr
