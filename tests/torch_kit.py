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
