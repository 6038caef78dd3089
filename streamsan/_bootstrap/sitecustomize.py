"""Start streamsan in every Python process that ``streamsan wrap`` runs (children, ``python -m``, pytest,
torchrun workers), the way coverage.py measures subprocesses.

``streamsan wrap`` puts this directory first on ``PYTHONPATH``, so Python's ``site`` imports this module at
start-up. It (a) calls ``streamsan.session.start_from_env()``, which reads ``STREAMSAN_SESSION_DIR`` (or, in a
run of ``streamsan confirm``, ``streamsan.confirm.runtime.start_from_env()``, which reads ``STREAMSAN_CONFIRM``);
a failure logs one line and never breaks the program; and (b) imports the ``sitecustomize`` module that this one hides,
if any, so the environment's own customization still runs.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _same_dir(entry: str) -> bool:
    try:
        return os.path.samefile(entry or os.curdir, _HERE)
    except OSError:
        return False


def _start() -> None:
    if os.environ.get("STREAMSAN_CONFIRM"):
        _start_confirm()
    if not os.environ.get("STREAMSAN_SESSION_DIR"):
        return
    try:
        try:
            import streamsan.session as session
        except ModuleNotFoundError as e:
            if e.name != "streamsan":
                raise
            # streamsan is not installed for this interpreter: use the copy this file belongs to.
            sys.path.append(os.path.dirname(os.path.dirname(_HERE)))
            import streamsan.session as session
        session.start_from_env()
    except Exception as e:  # never break the traced program
        print(f"streamsan: warning: tracing not started in process {os.getpid()}: {type(e).__name__}: {e}",
              file=sys.stderr)


def _start_confirm() -> None:
    """A run of ``streamsan confirm``: its runtime (delays and checksums at the planned call sites), not tracing."""
    try:
        try:
            import streamsan.confirm.runtime as runtime
        except ModuleNotFoundError as e:
            if e.name != "streamsan":
                raise
            sys.path.append(os.path.dirname(os.path.dirname(_HERE)))
            import streamsan.confirm.runtime as runtime
        runtime.start_from_env()
    except Exception as e:  # never break the program
        print(f"streamsan: warning: confirm not started in process {os.getpid()}: {type(e).__name__}: {e}",
              file=sys.stderr)


def _chain() -> None:
    """Import the sitecustomize this one shadows (the next one on sys.path), if any. This directory leaves
    sys.path for good (it holds nothing else); PYTHONPATH keeps it for child processes."""
    me = sys.modules.pop(__name__)
    sys.path[:] = [p for p in sys.path if not _same_dir(p)]
    try:
        import sitecustomize  # noqa: F401  (the environment's own, run for its side effects)
    except Exception as e:
        sys.modules[__name__] = me
        if not (isinstance(e, ImportError) and e.name == "sitecustomize"):
            print(f"streamsan: warning: the environment's sitecustomize failed: {type(e).__name__}: {e}",
                  file=sys.stderr)


_start()
_chain()
