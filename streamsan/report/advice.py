"""The two sentences of a finding that a user acts on: the missing edge and the fix.

Both are built from the report's own dicts (an access's ``agent``, ``op``, ``type``, ``location``), so they
read the same whether a report was built in-process or replayed. A stream is spelled as code where possible:
its role name (``prefetch_stream``), the current stream for the role ``default``, or a placeholder
(``<graph capture stream>``, ``<stream 0x...>``) when it is not code; calls are in the API of the library whose
stream the code holds (torch's ``wait_stream``, CuPy's ``wait_event(s.record())``, both for a mixed pair).
"""

from __future__ import annotations

from ..events import UNTRACED_REFILL
from ..analysis.findings import ALLOC_REUSE, HOST_DEVICE, MISSING_RECORD_STREAM


TORCH, CUPY = "torch", "cupy"


def library(access: dict, other: dict | None = None) -> str:
    """Whose stream object the code at an access holds: CuPy's when the op is CuPy's (``cupy.*``,
    ``cupyx.*``), else torch's. An allocation tells nothing: it goes by ``other``, the finding's other access."""
    op = access.get("op") or ""
    if op == "allocation" and other is not None:
        return library(other)
    return CUPY if op.startswith(("cupy.", "cupyx.")) else TORCH


def stream_code(agent: dict, lib: str = TORCH) -> str:
    """An expression for the agent's stream in ``lib``'s API, to paste into a fix; a placeholder ``<...>``
    where its name is no Python expression (``graph capture stream``, ``self.streams#2``, an unnamed stream)."""
    role = agent.get("role")
    if role == "default":
        return "cupy.cuda.get_current_stream()" if lib == CUPY else "torch.cuda.current_stream()"
    if role and all(part.isidentifier() for part in role.split(".")):
        return role
    return f"<{role}>" if role else f"<stream {agent.get('stream')}>"


def wait_code(waiter: dict, waiter_lib: str, waited: dict, waited_lib: str) -> str:
    """The call that makes ``waiter`` wait for the work queued so far on ``waited``, in the waiter's library
    (CuPy streams have no ``wait_stream``; a stream of the other library is wrapped by its handle)."""
    w, d = stream_code(waiter, waiter_lib), stream_code(waited, waited_lib)
    if waiter_lib == TORCH:
        return f"{w}.wait_stream({d if waited_lib == TORCH else f'torch.cuda.ExternalStream({d}.ptr)'})"
    event = f"{d}.record()" if waited_lib == CUPY else f"cupy.cuda.ExternalStream({d}.cuda_stream).record()"
    return f"{w}.wait_event({event})"


def _record_code(tensor: str, user: dict, user_lib: str) -> str:
    """``tensor.record_stream(s)``: a torch tensor's call, given a torch stream (a CuPy one wrapped)."""
    s = stream_code(user, user_lib)
    return f"{tensor}.record_stream({s if user_lib == TORCH else f'torch.cuda.ExternalStream({s}.ptr)'})"


def agent_text(agent: dict) -> str:
    """How a sentence names an agent: ``the host``, ``the default stream``, ``prefetch_stream``,
    ``stream 0x5a``."""
    if agent.get("kind") == "host":
        return "the host"
    role = agent.get("role")
    if role == "default":
        return "the default stream"
    return role or f"stream {agent.get('stream')}"


def _what(access: dict) -> str:
    return f"{access['op']} ({access['type']}) at {access['location']}"


def _owner_access(prev: dict, allocation: dict) -> bool:
    """The earlier access ran on the stream that owned the earlier tensor's memory."""
    owner = (allocation.get("previous_life") or {}).get("owner") or {}
    return owner.get("kind") == "stream" and owner.get("stream") == prev["agent"].get("stream")


def missing_edge(kind: str, prev: dict, cur: dict, allocation: dict) -> str:
    """What ordering is missing between the two accesses, as one sentence."""
    pa, ca = agent_text(prev["agent"]), agent_text(cur["agent"])
    if kind == MISSING_RECORD_STREAM:
        old = allocation.get("previous_life") or {}
        where = f" allocated at {old['location']}" if old.get("location") else ""
        owner = agent_text(old["owner"]) if old.get("owner") else ca
        tail = " It did on this run." if allocation.get("reused") else ""
        return (f"The tensor{where} on {owner} was used on {pa} ({_what(prev)}) and freed without "
                f"record_stream, and {ca} never waited for {pa}: the caching allocator was free to hand its "
                f"memory to the allocation at {cur['location']} on {ca} while that use may still be "
                f"pending.{tail}")
    if kind == ALLOC_REUSE:
        why = (f"the new tensor was allocated on {pa}, where that work was queued, but is used on {ca}"
               if _owner_access(prev, allocation) else
               f"{pa} was not recorded on the old tensor with record_stream, so the caching allocator did not "
               f"wait for it")
        return (f"The memory was freed and allocated again: {_what(cur)} on {ca} in the new allocation is not "
                f"ordered after {_what(prev)} on {pa} in the earlier one ({why}).")
    if kind == HOST_DEVICE and cur["op"] == UNTRACED_REFILL:
        return (f"The host rewrote bytes that {_what(prev)} reads, enqueued on {pa}, outside any traced call (a "
                f"NumPy view, ctypes, native code) before the next copy out of them at {cur['location']}, and "
                f"never synchronized with {pa} in between: the earlier copy may still have been reading them.")
    if kind == HOST_DEVICE and cur["agent"].get("kind") == "host":
        return (f"The host's {_what(cur)} may run while {_what(prev)}, enqueued on {pa}, is still in flight: "
                f"the host never synchronized with {pa} in between.")
    return f"{_what(cur)} on {ca} is not ordered after {_what(prev)} on {pa}: nothing makes {ca} wait for {pa}."


def fix(kind: str, prev: dict, cur: dict, memory: dict, allocation: dict) -> str:
    """A concrete change, with code, that adds the missing edge, in the API of the library whose streams the
    code at each access holds (:func:`library`)."""
    p_lib, c_lib = library(prev, cur), library(cur, prev)
    p = stream_code(prev["agent"], p_lib)
    wait = wait_code(cur["agent"], c_lib, prev["agent"], p_lib)
    tensor = (allocation.get("previous_life") or {}).get("label") or memory.get("label") or "tensor"
    if kind == MISSING_RECORD_STREAM and p_lib == CUPY:
        # (CuPy's memory pool has no record_stream: the array must stay alive, or the waiting be done first)
        return (f"Keep a reference to the array used at {prev['location']} until {p} is done with it, or call "
                f"`{wait}` before it is freed (at the latest before the allocation at {cur['location']}).")
    if kind == MISSING_RECORD_STREAM:
        return (f"Call `{_record_code(tensor, prev['agent'], p_lib)}` after the use at {prev['location']}, or "
                f"`{wait}` before the tensor is freed (at the latest before the allocation at "
                f"{cur['location']}).")
    if kind == ALLOC_REUSE and _owner_access(prev, allocation):
        # record_stream on the allocation stream is ignored by the allocator: only a wait helps.
        return f"Call `{wait}` before {cur['op']} at {cur['location']}."
    if kind == ALLOC_REUSE:
        return (f"Call `{_record_code(tensor, prev['agent'], p_lib)}` on the earlier tensor after {prev['op']} at "
                f"{prev['location']} so that the allocator waits for that stream before reusing its memory, or "
                f"`{wait}` before {cur['op']} at {cur['location']}.")
    if kind == HOST_DEVICE and cur["op"] == UNTRACED_REFILL:
        return (f"Call `{p}.synchronize()` (or `.synchronize()` on an event recorded after {prev['op']} at "
                f"{prev['location']}) before the host refills the buffer, or copy out of a different buffer each "
                f"step (one event per buffer, synchronized before it is refilled).")
    if kind == HOST_DEVICE and cur["agent"].get("kind") == "host":
        return (f"Call `{p}.synchronize()` (or `.synchronize()` on an event recorded after {prev['op']} at "
                f"{prev['location']}) before the host {cur['type']} at {cur['location']}.")
    if kind == HOST_DEVICE:
        return (f"Make sure the host's {prev['op']} at {prev['location']} is complete before {cur['op']} is "
                f"enqueued at {cur['location']}.")
    return (f"Call `{wait}` before {cur['op']} at {cur['location']} (or record an event on "
            f"{agent_text(prev['agent'])} after {prev['op']} at {prev['location']} and make "
            f"{agent_text(cur['agent'])} wait on it).")
