"""Threads, CUDA graphs, torch.compile, Triton, and proof that the tracer adds no synchronization."""

import queue
import threading

import torch
import torch.cuda._gpu_trace as gpu_trace

import streamsan
from streamsan.tracers.torch.cuda_graphs import GRAPH_NOTE
from streamsan.tracers.torch.patches.compile import COMPILE_NOTE

N = 1 << 16


def loader_thread(handoff_with_event):
    """A DataLoader-style pin-memory thread: pins a batch, copies it on its own stream, hands it over."""
    q = queue.Queue()

    def produce():
        s = torch.cuda.Stream()
        streamsan.name_stream(s, "loader")
        for i in range(3):
            p = torch.full((N,), float(i)).pin_memory()
            with torch.cuda.stream(s):
                x = p.to("cuda", non_blocking=True)
                e = torch.cuda.Event()
                e.record(s)
            q.put((x, e))

    t = threading.Thread(target=produce)
    t.start()
    t.join()
    total = torch.zeros(N, device="cuda")
    while not q.empty():
        x, e = q.get()
        if handoff_with_event:
            torch.cuda.current_stream().wait_event(e)
            x.record_stream(torch.cuda.current_stream())
        total += x
    torch.cuda.synchronize()


def test_loader_thread_with_event_handoff_is_clean(san):
    s, got = san(loader_thread, True)
    assert got == []


def test_loader_thread_without_handoff_races(san):
    s, got = san(loader_thread, False)
    assert ("device-device", "loader", "aten::_to_copy", "default", "aten::add_.Tensor") in got
    assert all(k in ("device-device", "missing-record-stream") for k, *_ in got)


def cuda_graph():
    s = torch.cuda.Stream()
    x = torch.ones(N, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        y = x * 2  # warm-up on the capture stream
        torch.cuda.current_stream().synchronize()
        with torch.cuda.graph(g, stream=s):
            y = x * 2
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    del y


def test_cuda_graph_replay_after_wait_stream(san):
    """The replay on the current stream, after it waited for the capture stream's warm-up: clean, with the note
    that says how replays are checked."""
    s, got = san(cuda_graph)
    assert got == []
    assert [text for _, text in s.analyzer.notes] == [GRAPH_NOTE]


def compiled():
    f = torch.compile(lambda a: (a * 2).sin())
    x = torch.ones(N, device="cuda")
    y = f(x)
    torch.cuda.synchronize()
    del y


def test_torch_compile_says_it_runs_eagerly(san):
    s, got = san(compiled)
    assert got == []
    assert [text for _, text in s.analyzer.notes] == [COMPILE_NOTE]


def compiled_with_cuda_graphs():
    """torch.compile(mode="reduce-overhead"): inductor's CUDA graph trees copy inputs into static buffers, capture,
    and replay on the current stream, with one memory pool shared by the graphs."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).cuda()
    f = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for i in range(4):
            x = torch.full((64, 256), float(i), device="cuda")
            y = f(x)
            y.sum().item()
    torch.cuda.synchronize()


def graphed_callables_training():
    """torch.cuda.make_graphed_callables: forward and backward graphs replayed in a training loop."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sample = torch.randn(32, 128, device="cuda", requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(model, (sample,))
    for _ in range(3):
        x, target = torch.randn(32, 128, device="cuda"), torch.randn(32, 4, device="cuda")
        loss = torch.nn.functional.mse_loss(graphed(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def test_graphed_callables_are_clean(san):
    s, got = san(graphed_callables_training)
    assert got == []
    assert GRAPH_NOTE in [text for _, text in s.analyzer.notes]


def test_compiled_reduce_overhead_is_clean(san):
    """Clean. Dynamo does not compile under streamsan's dispatch mode, so the model runs eagerly and no CUDA graph
    is recorded."""
    s, got = san(compiled_with_cuda_graphs)
    assert got == []
    assert [text for _, text in s.analyzer.notes] == [COMPILE_NOTE]


def count_syncs(fn):
    counts = {"stream": 0, "event": 0, "device": 0}
    torch._C._activate_gpu_trace()
    gpu_trace.register_callback_for_stream_synchronization(lambda s: counts.__setitem__("stream", counts["stream"] + 1))
    gpu_trace.register_callback_for_event_synchronization(lambda e: counts.__setitem__("event", counts["event"] + 1))
    gpu_trace.register_callback_for_device_synchronization(lambda: counts.__setitem__("device", counts["device"] + 1))
    fn()
    return dict(counts)


def workload():
    s = torch.cuda.Stream()
    x = torch.ones(N, device="cuda")
    for _ in range(20):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y = x * 2
        torch.cuda.current_stream().wait_stream(s)
        x = y + 1
        p = x.to("cpu", non_blocking=True)
        del p
    torch.cuda.synchronize()


def test_tracer_adds_no_synchronization():
    torch.cuda.synchronize()
    counts = []
    for traced in (False, True):
        box = {}

        def run():
            box["n"] = count_syncs(workload)

        if traced:
            with streamsan.watch():
                run()
        else:
            run()
        counts.append(box["n"])
    assert counts[0] == counts[1]
    assert counts[0]["device"] == 1
