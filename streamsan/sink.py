"""The event buffer between tracers and consumers (an analyzer, a trace file, or both).

Tracers append event tuples to :attr:`EventBuffer.events` (a plain list: the cheapest thing to do on a hot
path) and call :meth:`EventBuffer.flush` when it is long; every consumer gets each batch in order. Consumers
are callables taking a list of events.
"""

from __future__ import annotations

import threading

from . import events as E


class EventBuffer:
    """A list of pending events and the consumers that batches go to."""

    def __init__(self, consumers=(), batch: int = 512):
        self.events: list = []
        self.consumers = list(consumers)
        self.batch = batch
        self.total = 0
        self._lock = threading.Lock()
        self._flushing = None  # the thread flushing now
        self.ops_of_threads: dict = {}  # thread -> the op it is dispatching (a tracer's op_agent), events apart
        self._ctx_ids: dict[str, int] = {}
        self._ctx_texts: dict[int, str] = {}

    def flush(self) -> None:
        """Hand the pending events to every consumer, in order. A flush asked for from inside a consumer (by a
        callback that runs there: a garbage collection that frees a tensor fires PyTorch's free callback) returns at
        once, and its events go with the next flush: waiting for the flush in progress would wait forever."""
        me = threading.get_ident()
        if self._flushing == me:
            return
        with self._lock:
            self._flushing = me
            try:
                evs = self.events
                if not evs:
                    return
                self.events = []
                self.total += len(evs)
                for consume in tuple(self.consumers):  # (a tracer may add or remove a tap meanwhile)
                    consume(evs)
            finally:
                self._flushing = None

    def context_text(self, cid: int) -> str:
        return self._ctx_texts.get(cid, "")

    def context_id(self, text: str) -> int:
        """The id of a context text, defining it on first use."""
        cid = self._ctx_ids.get(text)
        if cid is None:
            cid = self._ctx_ids[text] = len(self._ctx_ids) + 1
            self._ctx_texts[cid] = text
            self.events.append((E.DEF_CONTEXT, cid, text))
        return cid
