"""The injected delay: GPU work that holds a stream back for about ``ms`` milliseconds without holding the host.

On a torch stream it is ``torch.cuda._sleep(cycles)`` (a kernel that spins on the SM clock); on a CuPy stream a
one-thread ``RawKernel`` spinning on ``clock64()``. Clock cycles per millisecond differ between GPUs and clock
states, so each is calibrated once, at the first delay, on a private stream timed with CUDA events: that waits for
the private stream alone, never for the program's streams.
"""

from __future__ import annotations

CALIBRATION_CYCLES = 2_000_000
_SPIN_SOURCE = r"""
extern "C" __global__ void streamsan_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


class TorchDelay:
    """A delay on the current torch stream."""

    def __init__(self, ms: float):
        self.ms = ms
        self.cycles = None

    def _calibrate(self, torch) -> int:
        stream = torch.cuda.Stream()
        per_ms = 0.0
        for _ in range(2):  # (the first launch pays for loading the kernel)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                torch.cuda._sleep(CALIBRATION_CYCLES)
                end.record(stream)
            end.synchronize()
            per_ms = CALIBRATION_CYCLES / max(start.elapsed_time(end), 1e-3)
        return max(1, int(self.ms * per_ms))

    def __call__(self) -> None:
        import torch

        if self.cycles is None:
            self.cycles = self._calibrate(torch)
        torch.cuda._sleep(self.cycles)


class CupyDelay:
    """A delay on a CuPy stream (None: the current one)."""

    def __init__(self, ms: float):
        self.ms = ms
        self.cycles = None
        self.kernel = None

    def _calibrate(self, cupy) -> int:
        import numpy

        stream = cupy.cuda.Stream(non_blocking=True)
        per_ms = 0.0
        for _ in range(2):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            with stream:
                start.record(stream)
                self.kernel((1,), (1,), (numpy.int64(CALIBRATION_CYCLES),))
                end.record(stream)
            end.synchronize()
            per_ms = CALIBRATION_CYCLES / max(cupy.cuda.get_elapsed_time(start, end), 1e-3)
        return max(1, int(self.ms * per_ms))

    def __call__(self, stream=None) -> None:
        import cupy
        import numpy

        if self.kernel is None:
            self.kernel = cupy.RawKernel(_SPIN_SOURCE, "streamsan_spin")
            self.cycles = self._calibrate(cupy)
        if stream is None:
            self.kernel((1,), (1,), (numpy.int64(self.cycles),))
        else:
            with stream:
                self.kernel((1,), (1,), (numpy.int64(self.cycles),))
