"""A live one-line status on a terminal's stderr during a long analysis, rewritten in place with a carriage
return and cleared at the end. Silent when the stream is not a terminal (a file, a pipe, CI logs)."""

from __future__ import annotations

import shutil
import time


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class StatusLine:
    """``update(text)`` shows text (at most every ``interval`` seconds, cut to the terminal's width);
    ``clear()`` erases it."""

    def __init__(self, stream, interval: float = 0.2, columns: int | None = None, clock=time.monotonic):
        self.stream = stream
        self.enabled = _isatty(stream)
        self.interval = interval
        self.columns = columns or shutil.get_terminal_size().columns
        self.clock = clock
        self._last = None
        self._width = 0

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if self._last is not None and now - self._last < self.interval:
            return
        self._last = now
        line = text[:self.columns - 1]
        self.stream.write("\r" + line + " " * max(0, self._width - len(line)))
        self.stream.flush()
        self._width = len(line)

    def clear(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


def analysis_text(name: str, index: int, total: int, events: int, findings: int) -> str:
    """``streamsan: analyzing trace-12.sstrace (1/3): 1,234,567 events, 2 findings so far``."""
    which = f" ({index}/{total})" if total > 1 else ""
    return (f"streamsan: analyzing {name}{which}: {events:,} events, {findings} finding"
            f"{'' if findings == 1 else 's'} so far")


def analysis_progress(status: StatusLine, name: str, index: int, total: int, before: int = 0):
    """A ``progress`` callback for :func:`streamsan.replay.replay_trace` that shows the analysis of the
    ``index``-th of ``total`` traces; ``before``: findings of the traces analyzed before it."""
    return lambda analyzer: status.update(analysis_text(name, index, total, analyzer.seq,
                                                        before + len(analyzer.findings)))
