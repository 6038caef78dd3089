"""Stream bugs of host threads and CUDA event subtleties, each as a small buggy program and its fix.

Two families of mistakes. Host threads: PyTorch's current stream is thread-local, so a thread started inside
``torch.cuda.stream(s)`` runs on the default stream (pytorch/pytorch#78824: ``parallel_apply`` did not forward the
caller's streams to its worker threads), a ``torch.cuda.set_stream`` a pooled thread never undoes stays with that
thread, and a result handed from a worker thread to another one through a queue carries no ordering with it (sglang's
overlap thread, ``TpModelWorkerClient`` in python/sglang/srt/managers/tp_worker_overlap_thread.py, hands
``copy_done`` over with its non-blocking device-to-host copies). CUDA events: an event denotes only its latest record
(torch/cutorch#222: a barrier recorded one event on every stream and waited once), a wait orders nothing after the
record it sees (sgl-project/sglang#14214 adds a value-based event "for the scenarios where the record happens later
than the wait"), a never-recorded event orders nothing, ``query()`` orders the host only when it returns True, and
timing events measure (and order) only the stream they are recorded on. The other pairs are common patterns, named
for what they do, with no particular issue behind them.

streamsan's host is one agent for all Python threads, its trace the real-time order of their calls: every
cross-thread program here hands over through ``queue.Queue`` / ``join()`` (or runs its threads one after the other)
so that the trace, and so the findings, are the same on every run. Races are decided by happens-before: each buggy
program is reported even when the GPU happens to finish first. The one exception is the bounded ``query()`` poll,
which is a race only when every poll returns False: its stream sleeps first (``torch.cuda._sleep``).

Every program is plain PyTorch with tensors of at most 1 << 16 elements. EXPECTED maps each scenario to the (kind,
previous stream role, previous op, current stream role, current op) tuples that docs/semantics.md implies, in the
order streamsan reports them; fixed programs expect ``[]``. Stream roles: "default" (the current stream), "host",
and the side streams each program names.
"""

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from tests.gpu.support.scenario_kit import scenario_tests, streams


N = 1 << 16
STEPS = 3
BUSY = 10_000_000  # GPU cycles of torch.cuda._sleep: milliseconds, far longer than a few query() calls
POLLS = 3  # the bounded poll's attempts


# ------------------------------------------------------------------ sglang overlap thread: D2H results via a queue
def _overlap_thread(handoff):
    """sglang's ``TpModelWorkerClient``, reduced: a forward thread runs each batch on its forward stream, copies the
    next token ids to the host with ``non_blocking=True`` and puts them on the output queue; the scheduler thread
    takes them and calls ``tolist()``. ``handoff``: "none" (nothing orders the copy), "event" (``copy_done``
    recorded after the copy, synchronized by the scheduler, as sglang does) or "stream" (the forward thread
    synchronizes its stream before it puts the result)."""
    (forward,) = streams("forward")
    B, D, V = 64, 128, 512
    h = torch.full((B, D), 0.01, device="cuda")
    w = torch.full((D, V), 0.01, device="cuda")
    torch.cuda.current_stream().synchronize()  # sglang: a stream sync before the batch goes to the forward thread
    inputs, outputs = queue.Queue(), queue.Queue()

    def forward_thread():
        with torch.cuda.stream(forward):
            for step in iter(inputs.get, None):
                logits = torch.mm(h, w) + step
                next_ids = logits.argmax(dim=-1).to("cpu", non_blocking=True)
                copy_done = torch.cuda.Event()
                copy_done.record()
                if handoff == "stream":
                    forward.synchronize()
                outputs.put((copy_done, next_ids))

    t = threading.Thread(target=forward_thread)
    t.start()
    tokens = []
    for step in range(STEPS):
        inputs.put(step)
        copy_done, next_ids = outputs.get()
        if handoff == "event":
            copy_done.synchronize()  # resolve_batch_result
        tokens.append(next_ids.tolist())
    inputs.put(None)
    t.join()
    torch.cuda.synchronize()


def overlap_thread_hands_over_pending_d2h():
    """The forward thread hands the scheduler thread a pinned tensor its non-blocking copy may still be writing, and
    nothing orders the scheduler's ``tolist()`` after the copy: the queue orders the threads, not the stream."""
    _overlap_thread("none")


def overlap_thread_hands_over_copy_done_event():
    """sglang's ``TpModelWorkerClient``: ``copy_done`` is recorded after the copies and put on the queue with them;
    ``resolve_batch_result`` synchronizes it before ``tolist()``."""
    _overlap_thread("event")


def overlap_thread_synchronizes_before_handoff():
    """Fixed in the worker instead: it synchronizes its stream before it puts the result on the queue (the host, one
    agent for all threads, has waited for the copy before the scheduler reads)."""
    _overlap_thread("stream")


# ------------------------------------------------------------------ producer thread -> consumer thread, two streams
def _two_stage_pipeline(wait_on_work_stream):
    """A preprocessing thread uploads and normalizes frames on its stream and hands each one over with an event
    recorded after its work; an inference thread waits for the event and reduces the frame on its own stream.
    ``ready.wait()`` waits on the calling thread's current stream: called before the consumer enters its stream
    context (the bug), that is the consumer thread's default stream, not the stream its work runs on."""
    producer, consumer = streams("producer", "consumer")
    frames = [torch.full((N,), float(i + 1)).pin_memory() for i in range(STEPS)]
    handoff = queue.Queue()
    sums = []

    def produce():
        with torch.cuda.stream(producer):
            for f in frames:
                x = f.to("cuda", non_blocking=True)
                x.mul_(1.0 / 255)  # normalize
                ready = torch.cuda.Event()
                ready.record()
                handoff.put((x, ready))
        handoff.put(None)

    def consume():
        for x, ready in iter(handoff.get, None):
            if not wait_on_work_stream:
                ready.wait()  # this thread's current stream: the default stream
            with torch.cuda.stream(consumer):
                if wait_on_work_stream:
                    ready.wait()  # the consumer stream
                sums.append(x.sum())
                x.record_stream(consumer)

    # one thread after the other, so that the trace order is fixed (the race does not depend on it)
    for target in (produce, consume):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    torch.cuda.synchronize()


def consumer_thread_waits_on_its_default_stream():
    """The consumer thread calls ``ready.wait()`` outside ``torch.cuda.stream(consumer)``: the wait lands on the
    thread's current stream (the default stream), and the consumer stream reads the frame with no edge on the
    producer stream's normalization."""
    _two_stage_pipeline(wait_on_work_stream=False)


def consumer_thread_waits_on_its_work_stream():
    """Fixed: the wait is made inside the stream context, on the stream that reads the frame."""
    _two_stage_pipeline(wait_on_work_stream=True)


# ------------------------------------------------------------------ one event recorded on several streams
def _sharded_load(event_per_record):
    """Two shards of a tensor are copied to the GPU on two streams; a barrier helper then makes the current stream
    wait for both, the way cutorch's ``streamWaitFor`` did before torch/cutorch#222: one event recorded on every
    stream, one wait. An event denotes only its latest record, so the wait covers the last stream only.
    ``event_per_record``: each record is waited for before the event is recorded again (one event per stream would do
    as well)."""
    shard0, shard1 = streams("shard0", "shard1")
    host = torch.full((2, N // 2), 1.0).pin_memory()
    dst = torch.empty(2, N // 2, device="cuda")
    cur = torch.cuda.current_stream()
    for i, s in enumerate((shard0, shard1)):
        with torch.cuda.stream(s):
            dst[i].copy_(host[i], non_blocking=True)
    barrier = torch.cuda.Event()
    for s in (shard0, shard1):
        barrier.record(s)
        if event_per_record:
            cur.wait_event(barrier)
    if not event_per_record:
        cur.wait_event(barrier)  # sees shard1's record only
    total = dst.sum()
    torch.cuda.synchronize()
    del total


def barrier_event_shared_across_streams():
    """Models torch/cutorch#222 ("the synchronization was performed only with the last stream on which the event was
    recorded"): the current stream reads shard 0 with no edge on the stream that copied it."""
    _sharded_load(event_per_record=False)


def barrier_waits_each_stream_record():
    """Fixed: every record of the barrier event is waited for before the event is recorded again; a wait keeps the
    record it saw."""
    _sharded_load(event_per_record=True)


# ------------------------------------------------------------------ an event that is never recorded
def _record_ready(into_waited_event):
    """A loader copies a batch to the GPU on its copy stream and marks it ready with ``copy.record_event(...)``; the
    training loop waits for ``ready``. ``Stream.record_event()`` without an argument records a new event and
    returns it: dropped, it leaves ``ready`` never recorded, and waiting for a never-recorded event is a no-op."""
    (copy,) = streams("copy")
    host = torch.full((N,), 2.0).pin_memory()
    ready = torch.cuda.Event()
    cur = torch.cuda.current_stream()
    with torch.cuda.stream(copy):
        batch = host.to("cuda", non_blocking=True)
    if into_waited_event:
        copy.record_event(ready)
    else:
        copy.record_event()  # a new event, dropped: `ready` is never recorded
    cur.wait_event(ready)
    batch.record_stream(cur)
    total = batch.sum()
    torch.cuda.synchronize()
    del total


def record_event_without_the_waited_event():
    """``copy.record_event()`` records an event nobody waits for; the current stream's wait for the never-recorded
    ``ready`` orders nothing, and it reads the batch the copy stream may still be writing."""
    _record_ready(into_waited_event=False)


def record_event_into_the_waited_event():
    """Fixed: ``copy.record_event(ready)`` records the event the consumer waits for."""
    _record_ready(into_waited_event=True)


# ------------------------------------------------------------------ Event.query() polling
def _poll_copy(until_done):
    """The host polls the copy's event instead of blocking in ``synchronize()``. A bounded poll that gives up after
    a few attempts and reads the result anyway learned nothing (only a ``query()`` that returns True orders the
    host after the event); polling until it is True does. The copy stream sleeps first, so the bounded poll really
    gives up."""
    (copy,) = streams("copy")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    out = torch.empty(N, pin_memory=True)
    copy.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(copy):
        torch.cuda._sleep(BUSY)  # the copy is queued behind other work
        out.copy_(x, non_blocking=True)
    done = copy.record_event()
    if until_done:
        while not done.query():
            pass
    else:
        for _ in range(POLLS):
            if done.query():
                break
    out.tolist()
    torch.cuda.synchronize()


def event_poll_gives_up_then_reads():
    """A bounded ``query()`` poll (a timeout) that falls through to the read while the copy is still pending: every
    ``query()`` returned False, so the host read of the pinned buffer is unordered with the copy into it."""
    _poll_copy(until_done=False)


def event_poll_until_done_then_reads():
    """Fixed: the host polls until ``query()`` returns True, which orders it after the copy."""
    _poll_copy(until_done=True)


# ------------------------------------------------------------------ set_stream leaked in a pooled thread
def _pooled_tasks(scoped):
    """Two tasks on a one-thread pool: ``prefetch`` uploads weights on its prefetch stream, ``to_host`` copies a
    result to the host on the thread's current stream, which its caller takes to be the default stream and
    synchronizes. ``prefetch`` selects its stream with ``torch.cuda.set_stream`` and never restores it (the bug);
    the current stream is per thread, so the pool's thread keeps it and runs ``to_host`` on the prefetch stream."""
    (prefetch_stream,) = streams("prefetch")
    w_host = torch.full((N,), 0.5).pin_memory()
    y = torch.empty(N, device="cuda")
    y.fill_(1.0)  # a result of the main thread, on the default stream

    def prefetch():
        prefetch_stream.wait_stream(torch.cuda.current_stream())
        if scoped:
            with torch.cuda.stream(prefetch_stream):
                return w_host.to("cuda", non_blocking=True)
        torch.cuda.set_stream(prefetch_stream)  # never restored: the pool's thread keeps it
        return w_host.to("cuda", non_blocking=True)

    def to_host(t):
        return t.to("cpu", non_blocking=True)

    with ThreadPoolExecutor(max_workers=1) as pool:
        w = pool.submit(prefetch).result()
        out = pool.submit(to_host, y).result()
    torch.cuda.current_stream().synchronize()  # the stream the caller believes the copy ran on
    out.tolist()
    torch.cuda.synchronize()
    del w


def pool_thread_leaks_set_stream():
    """``torch.cuda.set_stream`` in a pooled worker thread, never undone: the thread's next task enqueues its
    device-to-host copy on the prefetch stream, and the caller's synchronization of the default stream does not
    cover it before ``tolist()``."""
    _pooled_tasks(scoped=False)


def pool_thread_scopes_its_stream():
    """Fixed: the task selects its stream with the ``torch.cuda.stream`` context manager, which restores the
    thread's current stream when the task ends."""
    _pooled_tasks(scoped=True)


# ------------------------------------------------------------------ worker threads and the caller's current stream
def _replica_threads(forward_streams):
    """``parallel_apply``, reduced to one device: the caller runs on a stream of its own and starts a worker thread
    per replica; each worker computes its output, and the caller's stream sums them. A new thread's current stream
    is the default stream. ``forward_streams``: the caller's current stream is captured before the threads start and
    each worker enters it (torch/nn/parallel/parallel_apply.py since pytorch/pytorch#78824)."""
    (caller,) = streams("caller")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    caller.wait_stream(torch.cuda.current_stream())
    results = {}

    def worker(i, stream):
        if stream is None:
            results[i] = x * (i + 1)  # this thread's current stream: the default stream
        else:
            with torch.cuda.stream(stream):
                results[i] = x * (i + 1)

    with torch.cuda.stream(caller):
        stream = torch.cuda.current_stream() if forward_streams else None
        for i in range(2):  # one at a time, so that the trace order is fixed
            t = threading.Thread(target=worker, args=(i, stream))
            t.start()
            t.join()
        total = results[0] + results[1]
    torch.cuda.current_stream().wait_stream(caller)
    torch.cuda.synchronize()
    del total


def worker_threads_miss_caller_stream():
    """Models pytorch/pytorch#78824 (``parallel_apply`` "does not forward the thread local current streams from the
    parent thread"): the workers write their outputs on the default stream, and the caller's stream reads them with no
    edge on it."""
    _replica_threads(forward_streams=False)


def worker_threads_enter_caller_stream():
    """Fixed as ``parallel_apply`` is since pytorch/pytorch#78824: ``streams = [torch.cuda.current_stream(x) for x in
    devices]`` in the caller, ``torch.cuda.stream(stream)`` in each worker."""
    _replica_threads(forward_streams=True)


# ------------------------------------------------------------------ a wait made before the record it needs
def _on_demand_loader(wait_after_handoff):
    """A loader thread copies the batch the training loop asks for on its loader stream and re-records one shared
    ``ready`` event after each copy. The loop makes its stream wait for ``ready`` at the top of each iteration, before
    asking for the batch (the bug): the wait sees the previous batch's record (none the first time); a wait orders
    nothing recorded after it."""
    (loader,) = streams("loader")
    host = [torch.full((N,), float(i + 1)).pin_memory() for i in range(STEPS)]
    requests, batches = queue.Queue(), queue.Queue()
    ready = torch.cuda.Event()

    def load():
        for i in iter(requests.get, None):
            with torch.cuda.stream(loader):
                batch = host[i].to("cuda", non_blocking=True)
            ready.record(loader)
            batches.put(batch)

    t = threading.Thread(target=load)
    t.start()
    cur = torch.cuda.current_stream()
    total = torch.zeros(N, device="cuda")
    for i in range(STEPS):
        if not wait_after_handoff:
            cur.wait_event(ready)  # before the batch is even asked for
        requests.put(i)
        batch = batches.get()
        if wait_after_handoff:
            cur.wait_event(ready)
        total += batch
        batch.record_stream(cur)
    requests.put(None)
    t.join()
    torch.cuda.synchronize()


def wait_for_loader_event_before_request():
    """A wait made before the record it needs (the case sgl-project/sglang#14214 adds a value-based event for, "for
    the scenarios where the record happens later than the wait"): the current stream waits for the loader's event
    before the loader has recorded it for this batch, and reads the batch with no edge on its copy."""
    _on_demand_loader(wait_after_handoff=False)


def wait_for_loader_event_after_handoff():
    """Fixed: the loop waits for ``ready`` once the batch has been handed over, when the loader has recorded it."""
    _on_demand_loader(wait_after_handoff=True)


# ------------------------------------------------------------------ timing events on the wrong stream
def _timed_op(join_side_stream):
    """A benchmark harness times an op between two timing events on the current stream and checks the op's result
    after ``end.synchronize()``. The op overlaps its device-to-host copy on a stream of its own and (the bug) returns
    without making the current stream wait for it: the events bracket nothing of that stream, and ``end`` orders
    nothing of it."""
    (d2h,) = streams("d2h")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    out = torch.empty(N, pin_memory=True)

    def op():
        cur = torch.cuda.current_stream()
        d2h.wait_stream(cur)
        with torch.cuda.stream(d2h):
            out.copy_(x, non_blocking=True)
        if join_side_stream:
            cur.wait_stream(d2h)
        return out

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    result = op()
    end.record()
    end.synchronize()
    elapsed_ms = start.elapsed_time(end)
    result.tolist()  # check the result
    torch.cuda.synchronize()
    del elapsed_ms


def timing_end_event_misses_side_stream():
    """``end.synchronize()`` waits for the current stream only; the host reads the pinned result the op's side
    stream may still be writing."""
    _timed_op(join_side_stream=False)


def timing_end_event_after_joining_side_stream():
    """Fixed in the op: it makes the caller's current stream wait for its side stream before returning, so ``end``
    (recorded after) covers the copy, for the timing and for the read."""
    _timed_op(join_side_stream=True)


# ------------------------------------------------------------------ a pinned staging slot refilled by another thread
def _staging_thread(wait_copy_event):
    """A producer thread fills one pinned staging slot from pageable tensors (a tokenizer's output) and hands it to
    the main thread, which copies it to the GPU with ``non_blocking=True`` and hands the slot back at once with an
    event recorded after the copy. The producer refills the slot as soon as it has it back (the bug), while the copy
    may still be reading it; or after synchronizing the event (the fix). The single-threaded form of this race is
    vllm_pinned_inputs_refilled_before_h2d in test_inference.py."""
    src = [torch.full((N,), float(i + 1)) for i in range(STEPS)]
    slot = torch.empty(N, pin_memory=True)
    gpu = torch.empty(N, device="cuda")
    acc = torch.zeros(N, device="cuda")
    free, full = queue.Queue(), queue.Queue()

    def fill():
        for i in range(STEPS):
            copied = free.get()
            if copied is not None and wait_copy_event:
                copied.synchronize()
            slot.copy_(src[i])
            full.put(i)

    t = threading.Thread(target=fill)
    t.start()
    free.put(None)  # the slot starts free
    for _ in range(STEPS):
        full.get()
        gpu.copy_(slot, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        free.put(copied)  # hand the slot back right after enqueueing the copy
        acc += gpu
    t.join()
    torch.cuda.synchronize()


def staging_slot_refilled_while_h2d_pending():
    """The producer thread's refill of the pinned slot (a host write: the host is every thread) is unordered with
    the main thread's previous non-blocking copy out of it (write after read)."""
    _staging_thread(wait_copy_event=False)


def staging_slot_refilled_after_copy_event():
    """Fixed: the producer synchronizes the event that came back with the slot before refilling it."""
    _staging_thread(wait_copy_event=True)


SCENARIOS = [
    overlap_thread_hands_over_pending_d2h, overlap_thread_hands_over_copy_done_event,
    overlap_thread_synchronizes_before_handoff,
    consumer_thread_waits_on_its_default_stream, consumer_thread_waits_on_its_work_stream,
    barrier_event_shared_across_streams, barrier_waits_each_stream_record,
    record_event_without_the_waited_event, record_event_into_the_waited_event,
    event_poll_gives_up_then_reads, event_poll_until_done_then_reads,
    pool_thread_leaks_set_stream, pool_thread_scopes_its_stream,
    worker_threads_miss_caller_stream, worker_threads_enter_caller_stream,
    wait_for_loader_event_before_request, wait_for_loader_event_after_handoff,
    timing_end_event_misses_side_stream, timing_end_event_after_joining_side_stream,
    staging_slot_refilled_while_h2d_pending, staging_slot_refilled_after_copy_event,
]

# (kind, previous role, previous op, current role, current op) per scenario, in the order streamsan reports them.
# Every buggy program has one finding: its racing pair repeats at the same two call sites (one fingerprint, a count).
EXPECTED = {
    # the forward stream's D2H copy writes the pinned ids; the scheduler thread reads them (each step)
    "overlap_thread_hands_over_pending_d2h": [
        ("host-device", "forward", "aten::_to_copy", "host", "Tensor.tolist"),
    ],
    "overlap_thread_hands_over_copy_done_event": [],
    "overlap_thread_synchronizes_before_handoff": [],
    # RAW: the consumer stream's sum after the producer stream's normalize, the wait being on the default stream
    "consumer_thread_waits_on_its_default_stream": [
        ("device-device", "producer", "aten::mul_.Tensor", "consumer", "aten::sum"),
    ],
    "consumer_thread_waits_on_its_work_stream": [],
    # the wait sees shard1's record: shard 1's half is ordered, shard 0's is not
    "barrier_event_shared_across_streams": [
        ("device-device", "shard0", "aten::copy_", "default", "aten::sum"),
    ],
    "barrier_waits_each_stream_record": [],
    "record_event_without_the_waited_event": [
        ("device-device", "copy", "aten::_to_copy", "default", "aten::sum"),
    ],
    "record_event_into_the_waited_event": [],
    "event_poll_gives_up_then_reads": [
        ("host-device", "copy", "aten::copy_", "host", "Tensor.tolist"),
    ],
    "event_poll_until_done_then_reads": [],
    # to_host's copy ran on the leaked prefetch stream; the host synchronized the default stream only
    "pool_thread_leaks_set_stream": [
        ("host-device", "prefetch", "aten::_to_copy", "host", "Tensor.tolist"),
    ],
    "pool_thread_scopes_its_stream": [],
    # both replicas' outputs (one call site), read by one add on the caller stream
    "worker_threads_miss_caller_stream": [
        ("device-device", "default", "aten::mul.Tensor", "caller", "aten::add.Tensor"),
    ],
    "worker_threads_enter_caller_stream": [],
    # every step: step 0 waits for a never-recorded event, step k for batch k-1's record
    "wait_for_loader_event_before_request": [
        ("device-device", "loader", "aten::_to_copy", "default", "aten::add_.Tensor"),
    ],
    "wait_for_loader_event_after_handoff": [],
    "timing_end_event_misses_side_stream": [
        ("host-device", "d2h", "aten::copy_", "host", "Tensor.tolist"),
    ],
    "timing_end_event_after_joining_side_stream": [],
    # WAR: the refill of step k+1 after the H2D copy of step k
    "staging_slot_refilled_while_h2d_pending": [
        ("host-device", "default", "aten::copy_", "host", "aten::copy_"),
    ],
    "staging_slot_refilled_after_copy_event": [],
}


test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED)
