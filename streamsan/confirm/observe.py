"""Observed values: a checksum of an op's outputs, computed on the op's own stream, kept on the device and read
once at exit, so that observing adds no synchronization to the program.

A checksum is three float64 numbers over the elements of an op's outputs taken together: the sum of the finite
values, the sum of their magnitudes, and the count of the others (NaN, infinities). Pinned host outputs (a
non-blocking copy to the host) are copied back to the device on the same stream first, which orders the copy
after the op's own. :class:`Observations` keeps, in program order, which site each observed op was at, and the
checksums until :meth:`Observations.read`.
"""

from __future__ import annotations

import math

CHECKSUM = ("sum", "abs_sum", "non_finite")
MAX_VALUES_PER_SITE = 10_000  # occurrences of one site beyond this are counted, not checksummed
MAX_SEQUENCE = 1_000_000  # observed ops beyond this are not recorded; the run is marked truncated


def torch_checksum(torch, tensors):
    """The checksum of torch tensors as a 3-element float64 tensor on the current stream, or None when none
    of them is a device or pinned host tensor with elements."""
    parts = []
    for t in tensors:
        try:
            if t.layout != torch.strided or t.numel() == 0:
                continue
            x = t.detach()
            if not x.is_cuda:
                if not x.is_pinned():
                    continue
                x = x.to(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)
            if x.is_complex():
                x = torch.view_as_real(x)
            x = x.reshape(-1)
            if x.dtype == torch.bool:
                x = x.to(torch.uint8)
            x = x.to(torch.float64)
            finite = torch.isfinite(x)
            y = torch.where(finite, x, 0.0)
            parts.append(torch.stack([y.sum(), y.abs().sum(), (~finite).sum().to(torch.float64)]))
        except (RuntimeError, TypeError, NotImplementedError):
            continue  # (a tensor without values to read: meta, a subclass that refuses the ops...)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)


def cupy_checksum(cupy, arrays):
    """The checksum of CuPy arrays as a 3-element float64 array on the current CuPy stream, or None."""
    parts = []
    for a in arrays:
        if a.size == 0:
            continue
        x = a.ravel()
        if x.dtype.kind == "c":
            x = cupy.concatenate([x.real, x.imag])
        x = x.astype(cupy.float64)
        finite = cupy.isfinite(x)
        y = cupy.where(finite, x, 0.0)
        parts.append(cupy.stack([y.sum(), cupy.abs(y).sum(), (~finite).sum().astype(cupy.float64)]))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else cupy.stack(parts).sum(0)


class Observations:
    """What one run observed: ``sequence`` (the site index of each observed op, in program order) and, per
    (site, occurrence), the checksum left on the device."""

    def __init__(self, n_sites: int):
        self.counts = [0] * n_sites
        self.sequence: list[int] = []
        self.truncated = False
        self.pending: list = []  # (site, occurrence, library, device value)

    def arrive(self, site: int) -> int:
        """An op at ``site`` ran: its occurrence number (1-based)."""
        self.counts[site] += 1
        if len(self.sequence) < MAX_SEQUENCE:
            self.sequence.append(site)
        else:
            self.truncated = True
        return self.counts[site]

    def wants_value(self, site: int) -> bool:
        return self.counts[site] <= MAX_VALUES_PER_SITE

    def keep(self, site: int, occurrence: int, library: str, value) -> None:
        if value is not None:
            self.pending.append((site, occurrence, library, value))

    def read(self) -> list:
        """The checksums as ``[site, occurrence, [sum, abs_sum, non_finite]]`` rows: the one synchronization,
        at exit. Values that cannot be read (a CUDA error) are left out."""
        rows = []
        for site, occ, library, value in self.pending:
            try:
                host = value.tolist() if library == "torch" else value.get().tolist()
            except Exception:  # (the device is in an error state: nothing more can be read)
                break
            rows.append([site, occ, [None if isinstance(v, float) and math.isnan(v) else v for v in host]])
        self.pending.clear()
        return rows
