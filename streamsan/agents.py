"""Agent ids for streams, shared by every tracer of a session (torch and CuPy see the same CUDA streams).

A stream is keyed by (device index, raw ``cudaStream_t`` handle), never by a library object: PyTorch hands out
pooled streams round-robin, so two ``Stream`` objects can be one CUDA stream. The first sight of a key emits a
``STREAM`` event declaring its agent id.
"""

from __future__ import annotations

import threading

from . import events as E

LEGACY_HANDLES = (0, 1)  # NULL and cudaStreamLegacy both name the legacy default stream
PER_THREAD_HANDLE = 2  # cudaStreamPerThread


class StreamRegistry:
    """Maps (device, handle) to agent ids and declares them into an event buffer."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.agent_of: dict[tuple[int, int], int] = {}
        self.by_handle: dict[int, int] = {}
        self.flags_of: dict[tuple[int, int], int] = {}
        self._next = 1  # agent ids are never reused (a forgotten handle's agent keeps its history)
        self._created_names: dict[str, list[int]] = {}  # name of a creation site -> handles given it, in order
        self.named: set[tuple[int, int]] = set()  # (device, handle) of the streams that have a name
        self.collective: set[int] = set()  # agents collectives ran on (named "collective stream" once)
        # (re-entrant: a garbage collection inside _declare can run a callback that declares another stream)
        self._lock = threading.RLock()

    def agent(self, device: int, handle: int, flags: int | None = None) -> int:
        a = self.agent_of.get((device, handle))
        if a is None:
            a = self._declare(device, handle, flags)
        return a

    def _declare(self, device: int, handle: int, flags: int | None) -> int:
        with self._lock:
            key = (device, handle)
            a = self.agent_of.get(key)
            if a is not None:
                return a
            if handle in LEGACY_HANDLES:
                a0 = self.agent_of.get((device, 0 if handle == 1 else 1))
                if a0 is not None:  # the two spellings of the legacy stream are one agent
                    self.agent_of[key] = a0
                    return a0
            a = self._next
            self._next += 1
            self.agent_of[key] = a
            if handle not in LEGACY_HANDLES and handle != PER_THREAD_HANDLE:
                self.by_handle[handle] = a
            name = ""
            if handle in LEGACY_HANDLES:
                flags, name = E.LEGACY_DEFAULT, "default"
            elif handle == PER_THREAD_HANDLE:
                flags, name = E.BLOCKING, "per-thread default"
            elif flags is None:
                flags = 0
            self.flags_of[key] = flags
            if name:
                self.named.add(key)
            self.buffer.events.append((E.STREAM, a, device, handle, flags, name))
            return a

    def forget(self, device: int, handle: int) -> None:
        """A new stream got this handle (the old one was destroyed, its work may still run): the next use
        declares a new agent, unordered with the old one. Never used for the default streams."""
        if handle in LEGACY_HANDLES or handle == PER_THREAD_HANDLE:
            return
        with self._lock:
            a = self.agent_of.pop((device, handle), None)
            self.flags_of.pop((device, handle), None)
            self.named.discard((device, handle))
            if a is not None and self.by_handle.get(handle) == a:
                del self.by_handle[handle]

    def name(self, device: int, handle: int, name: str) -> None:
        """Give a stream a role name for reports (re-declares it with the same flags)."""
        a = self.agent(device, handle)
        self.named.add((device, handle))
        self.buffer.events.append((E.STREAM, a, device, handle, self.flags_of.get((device, handle), 0), name))

    def name_unnamed(self, device: int, handle: int, name: str) -> None:
        """Name a stream that has no name yet (a library's own stream, by its role)."""
        self.agent(device, handle)  # (a default stream is named when declared)
        if (device, handle) not in self.named:
            self.name(device, handle, name)

    def name_created(self, device: int, handle: int, name: str) -> None:
        """Name a stream just created after the expression its creating line assigns it to
        (:mod:`.tracers.naming`). Streams of other handles that got the same name before are told apart as
        ``name#2``, ``name#3``... (a list of streams made on one line)."""
        with self._lock:
            holders = self._created_names.setdefault(name, [])
            if handle not in holders:
                holders.append(handle)
            k = holders.index(handle)
        self.name(device, handle, name if k == 0 else f"{name}#{k + 1}")

    def for_handle(self, handle: int, current_device) -> int:
        """The agent of a raw handle seen without its device (GPU trace callbacks); ``current_device()`` is
        asked only for handles not seen before and for the per-device default streams."""
        if handle not in LEGACY_HANDLES and handle != PER_THREAD_HANDLE:
            a = self.by_handle.get(handle)
            if a is not None:
                return a
        return self.agent(current_device(), handle)
