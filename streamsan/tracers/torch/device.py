"""Which tensors the torch tracer takes for device tensors, where it reads the current stream and device, and the
key it knows a stream by.

CUDA's, unless a harness says otherwise: the CPU stand-in (``tests/support/standin.py``) makes CPU tensors play
CUDA's part, for a differential test of the C core and a benchmark without a GPU. Every part of the tracer reads
these names from this module when it runs (the C core gets them at ``configure``), so that setting them here
changes the whole tracer at once.
"""

from __future__ import annotations

import torch

ATTR = "is_cuda"  # the tensor attribute that is true for a tensor in device memory
OFFSET = 0  # added to ``Tensor.get_device()`` (the stand-in's CPU tensors say -1)
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # device -> the current stream's handle
current = getattr(torch._C, "_cuda_getDevice", None)  # () -> the current device
CUDA_TYPE = 1  # torch.Stream.device_type of a CUDA stream (c10::DeviceType::CUDA)


def stream_key(stream) -> tuple[int, int]:
    """(device index, raw cudaStream_t) of a torch.cuda.Stream or torch.Stream."""
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        handle = getattr(stream, "native_handle", None)
    dev = stream.device_index if hasattr(stream, "device_index") else stream.device.index
    if handle is None:
        cs = torch.cuda.Stream(stream_id=stream.stream_id, device_index=dev, device_type=stream.device_type)
        handle = cs.cuda_stream
    return dev, int(handle)
