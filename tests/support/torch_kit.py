"""What the torch tracer's CPU tests share: CPU tensors that say they are on CUDA device 0, and CPU tensors
registered with a tracer as pinned host blocks."""

import torch

from streamsan import events as E


class CudaLike(torch.Tensor):
    """A CPU tensor that says it is on CUDA device 0 (what the tracer reads of a tensor's place)."""

    @property
    def is_cuda(self):
        return True

    def get_device(self):
        return 0


def cuda_like(n):
    return torch.zeros(n).as_subclass(CudaLike)


def pin(tracer, host, what=""):
    """Declare ``host``'s memory a pinned block to ``tracer`` (its ALLOC event, and the tracer's own record of it),
    as if a pinning op had made it."""
    st = host.untyped_storage()
    tracer.buffer.events.append(E.alloc(E.PINNED, st.data_ptr(), st.nbytes(), E.HOST, what=what))
    tracer.pinned[st.data_ptr()] = st.nbytes()


SIDE = 1  # the stream of the copy that wrote or read a pinned block (pinned_after_copy)


def pinned_after_copy(n=16, batch=512, copy_writes=True):
    """(tracer, analyzer, host): a tracer (not started) feeding an analyzer, and a pinned block of ``n`` float32
    (``arange``) that a copy on stream SIDE has just written (or read: ``copy_writes=False``), which nothing
    waits for."""
    from streamsan.analysis.analyzer import Analyzer
    from streamsan.sink import EventBuffer
    from streamsan.tracers.torch.tracer import TorchTracer

    analyzer = Analyzer()
    tracer = TorchTracer(EventBuffer([analyzer.feed], batch=batch))
    host = torch.arange(n, dtype=torch.float32)
    st = host.untyped_storage()
    tracer.buffer.events.append(E.stream(SIDE, 0, 0x1000))
    pin(tracer, host, what=f"float32[{n}]")
    r = [E.rng(E.PINNED, st.data_ptr(), st.nbytes())]
    tracer.buffer.events.append(E.op(SIDE, "aten::copy_", writes=r) if copy_writes else
                                E.op(SIDE, "aten::copy_", reads=r))
    return tracer, analyzer, host


def findings_after(tracer, analyzer):
    """Stop tracing and analyze: (kind, (agent, op) before, (agent, op) after, lo, hi) of each finding."""
    tracer.stop()
    analyzer.finish()
    return [(f.kind, (f.previous.agent, f.previous.name), (f.current.agent, f.current.name), f.lo, f.hi)
            for f in analyzer.sorted_findings()]


def traced_after_copy():
    """A fixture body: (tracer, analyzer, host) of :func:`pinned_after_copy`, tracing until the test ends."""
    tracer, analyzer, host = pinned_after_copy()
    tracer.start()
    try:
        yield tracer, analyzer, host
    finally:
        tracer.stop()
