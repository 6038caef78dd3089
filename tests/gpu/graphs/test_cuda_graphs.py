"""CUDA graph replays on streams: each buggy program and its fix.

A replay is checked as one op, ``CUDAGraph.replay``, on the stream it runs on, that reads and writes all the memory
the graph's captured aten ops touch (static inputs and outputs, and pinned host memory a captured copy reads at
every replay). Graphs are captured as PyTorch's docs do it: a warm-up on a side stream, then ``torch.cuda.graph``.

EXPECTED maps each scenario to its (kind, previous stream role, previous op, current stream role, current op)
tuples; fixed programs expect ``[]``. Stream roles: "default" (the current stream), "host", and the side streams
each program names ("sched", "prelm", "compute", "copy").
"""

import pytest
import torch

from streamsan.tracers.torch.cuda_graphs import GRAPH_NOTE
from tests.gpu.support.scenario_kit import scenario_tests, streams

N = 1 << 16
BUSY = 2_000_000  # GPU cycles of torch.cuda._sleep: the replay is still running when the program goes on


def _capture(fn):
    """(graph, fn's output in the graph's memory): warm-up on a side stream, then capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


# ------------------------------------------------------------------ graph output consumed on another stream
def _encoder_calls(guarded):
    sched, prelm = streams("sched", "prelm")
    static_in = torch.zeros(N, device="cuda")
    g, static_out = _capture(lambda: static_in * 2 + 1)
    done = None
    results = []
    for step in range(2):
        with torch.cuda.stream(sched):
            if guarded and done is not None:
                sched.wait_event(done)  # the previous output's copy is finished
            static_in.fill_(float(step))
            g.replay()
        prelm.wait_stream(sched)
        with torch.cuda.stream(prelm):
            torch.cuda._sleep(BUSY)
            results.append(static_out.clone())  # the next replay overwrites static_out in place
            done = prelm.record_event()
    torch.cuda.synchronize()


def sglang_graph_output_cloned_while_next_replay_writes():
    """Models the review of sgl-project/sglang-omni#1369 (bucketed CUDA graphs for an encoder): the runner clones
    ``static_out`` and releases its lock, "the clone is asynchronous, so releasing this CPU lock can let the
    scheduler stream overwrite static_out before the pre-LM stream finishes copying it"."""
    _encoder_calls(guarded=False)


def sglang_graph_output_guarded_by_event():
    """The fix in the same pull request: record an event after each output copy and wait on it before the next call
    touches any static buffer."""
    _encoder_calls(guarded=True)


# ------------------------------------------------------------------ next input staged on a copy stream
def _staged_inputs(waits):
    compute, copy = streams("compute", "copy")
    static_in = torch.zeros(N, device="cuda")
    g, _ = _capture(lambda: static_in.sin())
    host = torch.randn(N).pin_memory()
    for _step in range(2):
        with torch.cuda.stream(copy):
            if waits:
                copy.wait_stream(compute)  # the previous replay has read its input
            static_in.copy_(host, non_blocking=True)
        compute.wait_stream(copy)
        with torch.cuda.stream(compute):
            g.replay()
            torch.cuda._sleep(BUSY)
    torch.cuda.synchronize()


def llama_cpp_next_input_overwrites_replay_input():
    """Models the analysis in ggml-org/llama.cpp#27572: nothing orders "graph k finishing its reads from the reused
    input tensor" before "the H2D write for ubatch k+1 overwriting that tensor"; here the next input is copied on
    a copy stream that never waits for the compute stream replaying the graph."""
    _staged_inputs(waits=False)


def llama_cpp_copy_stream_waits_for_replay():
    """The fix: the copy stream waits for the compute stream before overwriting the graph's input."""
    _staged_inputs(waits=True)


# ------------------------------------------------------------------ a captured copy out of pinned host memory
def _captured_h2d(synchronize):
    host = torch.zeros(N, pin_memory=True)
    dev = torch.zeros(N, device="cuda")

    def step():
        dev.copy_(host, non_blocking=True)  # captured: the node reads the host address at every replay
        return dev * 2

    g, _ = _capture(step)
    for i in range(2):
        if synchronize:
            torch.cuda.current_stream().synchronize()  # the previous replay has read the host buffer
        host.fill_(float(i))
        torch.cuda._sleep(BUSY)
        g.replay()
    torch.cuda.synchronize()


def onnxruntime_captured_h2d_buffer_refilled():
    """Models microsoft/onnxruntime#32121: under stream capture a host-to-device copy "is not a copy, it is a node,
    and the node records the host address: every replay re-reads whatever that block holds". Here the host refills
    the pinned buffer for the next replay while the previous replay may still be reading it."""
    _captured_h2d(synchronize=False)


def onnxruntime_captured_h2d_after_sync():
    """The fix: the host waits for the previous replay before it writes the buffer the graph reads."""
    _captured_h2d(synchronize=True)


# ------------------------------------------------------------------ PyTorch's documented whole-network capture
def graph_docs_example_is_clean():
    """torch.cuda.graphs' documented pattern: fill the static input, replay, read the static output, all on the
    current stream."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU()).cuda()
    static_in = torch.randn(64, 256, device="cuda")
    with torch.no_grad():
        g, static_out = _capture(lambda: model(static_in))
        total = torch.zeros((), device="cuda")
        for _ in range(3):
            static_in.copy_(torch.randn(64, 256, device="cuda"))
            g.replay()
            total += static_out.sum()
    torch.cuda.synchronize()


# ------------------------------------------------------------------ graphs replayed at once, one memory pool
def _concurrent_heads(shared_pool):
    """Two heads captured as graphs and replayed at once on two streams to overlap them. PyTorch's docs: graphs
    may share a memory pool only if they never run concurrently; each capture frees its intermediates back to its
    pool, and the second capture into a shared pool reuses them. Both replays also have PyTorch write the CUDA
    generator's seed and offset before they run (the same memory for every graph): PyTorch's bookkeeping."""
    h0, h1 = streams("head0", "head1")
    xs = [torch.randn(256, 1024, device="cuda") for _ in range(2)]
    pool = torch.cuda.graph_pool_handle() if shared_pool else None

    def head(x):
        h = torch.tanh(x * 2)
        return (h * h + 1).softmax(-1)

    graphs, outs = [], []
    for x in xs:
        g, out = _capture(lambda: head(x)) if not shared_pool else (torch.cuda.CUDAGraph(), None)
        if shared_pool:
            head(x)  # (the warm-up)
            with torch.cuda.graph(g, pool=pool):
                out = head(x)
        graphs.append(g)
        outs.append(out)
    main = torch.cuda.current_stream()
    total = torch.zeros((), device="cuda")
    for _ in range(3):
        for g, s in zip(graphs, (h0, h1)):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                g.replay()
        for s in (h0, h1):
            main.wait_stream(s)
        total += outs[0].sum() + outs[1].sum()
    torch.cuda.synchronize()


def graph_pool_shared_by_concurrent_replays():
    _concurrent_heads(shared_pool=True)


def graph_pools_private_to_concurrent_replays():
    _concurrent_heads(shared_pool=False)


# ------------------------------------------------------------------ a fork and join inside one capture
def _fork_inside_capture(fork_early):
    """A block whose capture forks a side stream off the capture stream (``side.wait_stream(cur)``: an event
    edge of the graph) for a consumer and joins it back before the capture ends. Forked before the consumer's
    input is produced, the side branch has no edge from the producer: a race inside the graph, at every replay,
    although the capture succeeds. (The warm-up runs on one stream: the race is the graph's alone.)"""
    capture, side = streams("capture", "side")
    x = torch.randn(N, device="cuda")
    h, gate, aux, out = (torch.empty(N, device="cuda") for _ in range(4))

    def block(fork):
        cur = torch.cuda.current_stream()
        torch.mul(x, 2.0, out=h)
        if fork and fork_early:
            side.wait_stream(cur)
        torch.sigmoid(h, out=gate)
        if fork and not fork_early:
            side.wait_stream(cur)
        with torch.cuda.stream(side if fork else cur):
            torch.mul(gate, h, out=aux)
        torch.mul(h, 0.5, out=out)
        if fork:
            cur.wait_stream(side)
        out.add_(aux)

    block(fork=False)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=capture):
        block(fork=True)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()


def graph_branch_forked_before_its_input():
    _fork_inside_capture(fork_early=True)


def graph_branch_forked_after_its_input():
    _fork_inside_capture(fork_early=False)


SCENARIOS = [
    graph_branch_forked_before_its_input, graph_branch_forked_after_its_input,
    graph_pool_shared_by_concurrent_replays, graph_pools_private_to_concurrent_replays,
    sglang_graph_output_cloned_while_next_replay_writes, sglang_graph_output_guarded_by_event,
    llama_cpp_next_input_overwrites_replay_input, llama_cpp_copy_stream_waits_for_replay,
    onnxruntime_captured_h2d_buffer_refilled, onnxruntime_captured_h2d_after_sync,
    graph_docs_example_is_clean,
]

EXPECTED = {
    "graph_branch_forked_before_its_input": [
        ("device-device", "capture", "aten::sigmoid.out", "side", "aten::mul.out"),
    ],
    "graph_branch_forked_after_its_input": [],
    "graph_pool_shared_by_concurrent_replays": [
        ("device-device", "head0", "CUDAGraph.replay", "head1", "CUDAGraph.replay"),
    ],
    "graph_pools_private_to_concurrent_replays": [],
    "sglang_graph_output_cloned_while_next_replay_writes": [
        ("device-device", "prelm", "aten::clone", "sched", "CUDAGraph.replay"),
    ],
    "sglang_graph_output_guarded_by_event": [],
    "llama_cpp_next_input_overwrites_replay_input": [
        ("device-device", "compute", "CUDAGraph.replay", "copy", "aten::copy_"),
    ],
    "llama_cpp_copy_stream_waits_for_replay": [],
    "onnxruntime_captured_h2d_buffer_refilled": [
        ("host-device", "default", "CUDAGraph.replay", "host", "aten::fill_.Scalar"),
    ],
    "onnxruntime_captured_h2d_after_sync": [],
    "graph_docs_example_is_clean": [],
}


# Under cudaMallocAsync a capture's allocations are the graph's own memory nodes, whatever pool it names: the two
# graphs share no bytes.
UNDER_ASYNC = {"graph_pool_shared_by_concurrent_replays": []}

test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED, under_async=UNDER_ASYNC)


def test_a_replay_says_how_it_is_checked(san):
    session, got = san(graph_docs_example_is_clean)
    assert got == []
    assert [text for _, text in session.analyzer.notes] == [GRAPH_NOTE]


def test_cupy_captured_calls_do_not_run_at_capture(san):
    """CuPy: a call captured into a graph on a non-blocking stream does not read ``x`` then, so the null stream
    refilling ``x`` right after the capture is no race; the launch after a device synchronization is ordered
    after the refill (a note says how graphs are checked; tests/gpu/test_cupy_graph_capture.py has the rest)."""
    cupy = pytest.importorskip("cupy")
    if not cupy.cuda.is_available():
        pytest.skip("needs CuPy with a CUDA GPU")
    from streamsan.tracers.cupy.patches.graphs import GRAPH_NOTE as CUPY_GRAPH_NOTE

    def program():
        (cap,) = streams("capture", make=lambda: cupy.cuda.Stream(non_blocking=True))
        x = cupy.ones(N, dtype=cupy.float32)
        y = cupy.empty(N, dtype=cupy.float32)
        cupy.cuda.Device().synchronize()
        with cap:
            cupy.multiply(x, 2.0, out=y)  # warm-up: the kernel is compiled and loaded before the capture
        cupy.cuda.Device().synchronize()
        with cap:
            cap.begin_capture()
            cupy.multiply(x, 2.0, out=y)
            graph = cap.end_capture()
        x.fill(3.0)  # the null stream: the captured multiply has not run
        cupy.cuda.Device().synchronize()
        graph.launch(stream=cap)
        cap.synchronize()

    session, got = san(program)
    assert got == []
    assert CUPY_GRAPH_NOTE in [text for _, text in session.analyzer.notes]
