"""Stream bugs of numeric code on CuPy (its linear algebra, FFT and image filters, raw kernels, per-thread default
streams, events and pool arenas, as cuSignal and cuML use them), each as a small buggy program and its fix.

Every pair reproduces the pattern of a stream bug reported against CuPy itself or a project built on it (cuSignal,
cuML), named in its docstring with the issue / PR and what raced, or, where no report was found, a common pattern
(said so). The programs use plain CuPy (no code of those projects, no downloads, arrays of at most 1 << 16
elements) and only what docs/cupy.md says the CuPy tracer sees: ``cupy.linalg`` / ``cupy.fft`` /
``cupyx.scipy.ndimage`` functions, raw kernels, ``ndarray.set`` / ``cupy.asarray`` / ``cupy.asnumpy``, pinned
``cupyx.empty_pinned`` arrays, ``Stream.ptds``, ``Stream.use``, ``Event.done``, ``Device().synchronize()`` and the
memory pool's per-stream arenas. The buggy function must give exactly the findings in EXPECTED (kind, previous
stream role, previous op, current stream role, current op); the fixed one must give none.

Stream roles: "default" (the legacy default stream, CuPy's ``Stream.null``), "per-thread default" (``Stream.ptds``),
"host", and the side streams each program names with streamsan.name_stream ("inv", "kf0" / "kf1", "user", "fft" /
"filter", "d2h", "work", "load" / "compute"). Side streams are non-blocking unless the docstring says otherwise.
Skipped without CUDA, torch (the shared conftest needs it) or CuPy.
"""

import contextlib

import numpy

import streamsan
from tests.gpu.support.scenario_kit import cupy_streams as streams
from tests.gpu.support.scenario_kit import need_cupy, scenario_tests

cupy, cupyx = need_cupy()

N = 1 << 16
F32 = numpy.float32


def device_sync():
    cupy.cuda.Device().synchronize()


# ------------------------------------------------------------------ the wrong stream synchronized before a solve
def _batched_inverse(device_sync_first):
    n, batch = 16, 8
    a = cupy.empty((batch, n, n), dtype=cupy.float64)
    for i in range(batch):
        a[i] = cupy.eye(n, dtype=cupy.float64)  # the batch is built on the null stream
    (inv_stream,) = streams("inv")
    if device_sync_first:
        cupy.cuda.Device().synchronize()  # every stream of the device, the null stream's setitems included
    else:
        inv_stream.synchronize()  # the stream about to be used: idle, so this orders nothing
    with inv_stream:
        a_inv = cupy.linalg.inv(a)  # cuBLAS batched LU on the non-blocking stream reads the batch
        check = a_inv.get()
    device_sync()
    del check


def linalg_inv_after_syncing_idle_stream():
    """Models cupy/cupy#8599 ("cp.linalg.inv of identity producing NANs"): the batch of matrices is filled with
    ``a_d[i] = cp.eye(...)`` on the null stream, then ``stream1 = Stream(non_blocking=True)``,
    ``stream1.synchronize()`` and ``with stream1: cp.linalg.inv(a_d)``. Synchronizing the new, idle stream does
    not wait for the null stream, and a non-blocking stream is not ordered after it, so the inversion may read
    the batch before the setitems have written it (NaNs and infs in the reporter's second call)."""
    _batched_inverse(device_sync_first=False)


def linalg_inv_after_device_sync():
    """What the report of cupy/cupy#8599 found to work: an additional device synchronization
    (``cupy.cuda.Device().synchronize()``) before the solve; the null stream's setitems are done first."""
    _batched_inverse(device_sync_first=True)


# ------------------------------------------------------------------ Stream.use() leaking out of a library call
KF_PREDICT = r'''
extern "C" __global__ void streamsan_kf_predict(float* x, const float* F, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = F[i] * x[i];
}
'''
KF_POINTS = 1 << 12


class _KalmanFilter:
    """cuSignal's KalmanFilter, reduced: state arrays and a CuPy stream of its own; ``predict`` launches the
    predict kernel on that stream, either after ``self.stream.use()`` (``scoped=False``) or inside
    ``with self.stream:``."""

    def __init__(self, stream, kernel, scoped):
        self.stream = stream
        self.kernel = kernel
        self.scoped = scoped
        with stream:
            self.x = cupy.ones(KF_POINTS, dtype=F32)  # state
            self.F = cupy.full(KF_POINTS, 0.9, dtype=F32)  # state transition

    def predict(self):
        args = (self.x, self.F, numpy.int32(KF_POINTS))
        if self.scoped:
            with self.stream:
                self.kernel((KF_POINTS // 256,), (256,), args)
        else:
            self.stream.use()  # stays the thread's current stream after predict() returns
            self.kernel((KF_POINTS // 256,), (256,), args)


def _two_trackers(scoped):
    kf_streams = streams("kf0", "kf1", non_blocking=False)  # CuPy's default, blocking, streams
    kernel = streamsan.cupy_access(cupy.RawKernel(KF_PREDICT, "streamsan_kf_predict"), reads=("F",))
    try:
        filters = [_KalmanFilter(s, kernel, scoped) for s in kf_streams]
        for kf in filters:
            kf.predict()
        fused = filters[0].x + filters[1].x  # the caller's own CuPy code, meant for the null stream
        device_sync()
        del fused
    finally:
        cupy.cuda.Stream.null.use()  # leave the thread as the test found it


def cusignal_stream_use_leaks_into_caller():
    """Models the stream leak of rapidsai/cusignal#115 ("Fix stream usage for all functions"): the Kalman
    filter's kernel wrappers called ``self.stream.use()`` before launching, which leaves that stream current
    after the call; it showed "running multiple cuSignal API calls in a loop" as cupy/cupy#3316 (a used stream
    later collected left a dead current stream). The same leak also moves the caller's next CuPy call onto the
    last filter's stream: with two filters, each on a blocking stream of its own, ``kf0.x + kf1.x`` runs on
    kf1's stream, which is ordered after the null stream but not after kf0's stream, so it may read kf0's state
    before kf0's predict kernel has written it."""
    _two_trackers(scoped=False)


def cusignal_stream_scoped_with_block():
    """The fix rapidsai/cusignal#115 proposes: ``with self.stream:`` around each launch, so the caller's code stays
    on the null stream, which the legacy default stream semantics order after both blocking filter streams."""
    _two_trackers(scoped=True)


# ------------------------------------------------------------------ a raw kernel on the user's stream, copies not
LOMB = r'''
extern "C" __global__ void streamsan_lombscargle(const float* x, float* pgram, int n, int nf) {
    int f = blockIdx.x * blockDim.x + threadIdx.x;
    if (f < nf) {
        float acc = 0.0f;
        for (int i = 0; i < n; i += 64) acc += x[i] * (float)(f + 1);
        pgram[f] = acc;
    }
}
'''
NF = 1024


def _periodogram(transfers_on_stream):
    (user,) = streams("user")
    kernel = streamsan.cupy_access(cupy.RawKernel(LOMB, "streamsan_lombscargle"), reads=("x",), writes=("pgram",))
    signal = numpy.sin(numpy.arange(N, dtype=F32) * 0.01).astype(F32)  # pageable host samples
    copies = user if transfers_on_stream else contextlib.nullcontext()
    with copies:
        x = cupy.asarray(signal)  # H2D on the current stream
        pgram = cupy.empty(NF, dtype=F32)
    kernel((NF // 128,), (128,), (x, pgram, numpy.int32(N), numpy.int32(NF)), stream=user)
    with copies:
        power = cupy.asnumpy(pgram)  # D2H on the current stream, blocking
    device_sync()
    del power


def cusignal_raw_kernel_on_stream_copies_on_default():
    """Models rapidsai/cusignal#123 ("Not utilizing streams in functions with raw kernels"): with a user stream
    passed in, cuSignal's raw kernels ran on it but the data transfers around them did not (the report's profile
    of lombscargle shows the kernels on the custom stream and the transfers on the default stream; it warns of
    "poor/invalid performance"). With a non-blocking user stream nothing orders the read-back after the kernel:
    it may copy the periodogram before the kernel has written it. (The upload is safe here only by accident of
    CuPy's implementation: from pageable memory, ``cupy.asarray`` records an event after its copy and waits on it,
    which orders the host, and so the kernel's launch, after the upload: measured on an H200 with CuPy 14.)"""
    _periodogram(transfers_on_stream=False)


def cusignal_copies_on_user_stream():
    """The fix rapidsai/cusignal#123 calls for: the transfers run on the user stream as well (here inside
    ``with stream:``), in order with the kernel."""
    _periodogram(transfers_on_stream=True)


# ------------------------------------------------------------------ cuML's CuPy work on the per-thread stream
def _center_then_score(sync_ptds):
    (user,) = streams("user", non_blocking=False)  # a blocking stream: ordered with the legacy stream only
    X = cupy.empty((256, 64), dtype=F32)
    X.fill(1.0)  # the caller's data, on the legacy default stream
    with cupy.cuda.Stream.ptds:  # where the library now runs its CuPy work
        centered = X - X.mean(axis=0)  # returned without synchronizing the per-thread stream
    if sync_ptds:
        cupy.cuda.Stream.ptds.synchronize()
    with user:
        score = (centered * centered).sum()  # the caller consumes the output on a stream of its own
    device_sync()
    del score


def cuml_ptds_output_consumed_on_user_stream():
    """Models the hazard NVIDIA/cuml#8086 ("Use the PTDS for (most) cupy operations") documents as its breaking
    change: cuML's CuPy operations moved from the legacy default stream to the per-thread default stream and
    return without synchronizing it. Before, a consumer on a blocking CuPy stream was ordered after them by the
    legacy stream's implicit synchronization; the per-thread stream is ordered with the legacy stream only, so
    a consumer on "a stream other than the legacy stream" may read the output early. Shown in one thread (the
    PR's example hands the array to another thread; streamsan takes every thread's per-thread stream for one
    stream, docs/cupy.md)."""
    _center_then_score(sync_ptds=False)


def cuml_ptds_synchronized_before_use():
    """The remedy NVIDIA/cuml#8086 gives: synchronize the per-thread default stream
    (``cupy.cuda.Stream.ptds.synchronize()``) before using the output on another stream."""
    _center_then_score(sync_ptds=True)


# ------------------------------------------------------------------ cuFFT on one stream, the filter on another
def _spectral_filter(join):
    fft_stream, filter_stream = streams("fft", "filter")
    with fft_stream:
        t = cupy.arange(N, dtype=F32)
        x = cupy.sin(t * 0.01)
        spectrum = cupy.fft.rfft(x)  # cuFFT runs on the current stream
    if join:
        filter_stream.wait_event(fft_stream.record())
    with filter_stream:
        response = cupy.ones(N // 2 + 1, dtype=cupy.complex64)
        filtered = cupy.fft.irfft(spectrum * response, n=N)
        peak = filtered.max()
    device_sync()
    del peak


def cufft_spectrum_used_on_other_stream():
    """A common pattern (no single report): a spectral filter split over two streams, the forward transform
    (``cupy.fft.rfft`` under ``with fft_stream:``; ``cupy.fft`` follows the current stream, cupy/cupy#926 and
    cupy/cupy#2357) and the multiply + inverse transform on a second stream that never waits for the first,
    so the multiply may read the spectrum before cuFFT has written it."""
    _spectral_filter(join=False)


def cufft_spectrum_after_wait_event():
    """The fix: the filter stream waits for an event recorded on the FFT stream after the transform."""
    _spectral_filter(join=True)


# ------------------------------------------------------------------ an event recorded before the copy it guards
def _poll_then_read(record_after_copy):
    (d2h,) = streams("d2h")
    with d2h:
        scores = cupy.arange(N, dtype=F32)  # the result, made on the copy stream
    host = cupyx.empty_pinned(N, dtype=F32)
    copied = cupy.cuda.Event()
    if not record_after_copy:
        copied.record(d2h)  # enqueued before the copy: it marks the arange only
    cupy.asnumpy(scores, stream=d2h, out=host, blocking=False)
    if record_after_copy:
        copied.record(d2h)
    while not copied.done:  # the host polls instead of blocking
        pass
    total = host.sum()
    device_sync()
    del total


def event_recorded_before_async_d2h():
    """A common pattern (no single report): an asynchronous ``cupy.asnumpy(..., blocking=False)`` into pinned
    memory guarded by an event the host polls with ``Event.done``, but the event is recorded before the copy
    is enqueued, so it completes once the earlier work has, and the host reads the pinned result while the copy
    may still be writing it."""
    _poll_then_read(record_after_copy=False)


def event_recorded_after_async_d2h():
    """The fix: record the event after the copy; ``Event.done`` returning True then means the copy is done."""
    _poll_then_read(record_after_copy=True)


# ------------------------------------------------------------------ scratch from the wrong stream's arena
def _chunk_sums(allocate_on_stream):
    (work,) = streams("work")
    sums = []
    for step in range(2):
        if allocate_on_stream:
            with work:
                scratch = cupy.empty(N, dtype=F32)  # filed under the work stream's arena
        else:
            scratch = cupy.empty(N, dtype=F32)  # outside the stream: filed under the null stream's arena
        with work:
            scratch.fill(step + 1.0)
            sums.append(scratch.sum())
        del scratch  # back to its arena while the work stream may still read it
    device_sync()
    del sums


def scratch_allocated_outside_stream_reused():
    """A common pattern, the hazard cupy/cupy#8068 describes (CuPy's pool keeps one arena per stream and has no
    ``record_stream``): a scratch buffer allocated outside ``with stream:`` belongs to the null stream's arena
    although only the work stream uses it. Dropped, it goes back to that arena at once, and the null stream's
    next allocation (the next chunk's scratch) may get the block while the work stream may still read it."""
    _chunk_sums(allocate_on_stream=False)


def scratch_allocated_on_its_stream():
    """The fix: allocate the scratch inside ``with stream:``. Its block returns to the work stream's arena, which
    only the work stream allocates from, in order after its own use."""
    _chunk_sums(allocate_on_stream=True)


# ------------------------------------------------------------------ a tile uploaded on a loader stream
R = 128


def _tile_filter(wait_for_load):
    from cupyx.scipy import ndimage  # its functions are traced once it is imported

    load, compute = streams("load", "compute")
    tile = cupyx.empty_pinned((R, R), dtype=F32)
    tile[...] = 0.25  # the host decodes the tile into pinned memory
    with compute:
        image = cupy.empty((R, R), dtype=F32)
    image.set(tile, stream=load)  # the loader's asynchronous H2D
    if wait_for_load:
        compute.wait_event(load.record())
    with compute:
        smoothed = ndimage.gaussian_filter(image, sigma=2.0)  # cuCIM-style filtering on the compute stream
        level = smoothed.mean()
    device_sync()
    del level


def tile_filtered_before_upload():
    """A common pattern (no single report): a loader stream uploads each image tile with
    ``ndarray.set(tile, stream=load)`` and the compute stream runs ``cupyx.scipy.ndimage`` filters (what cuCIM
    builds on) on it without waiting for the upload, so the filter may read the tile before it has arrived."""
    _tile_filter(wait_for_load=False)


def tile_filtered_after_wait_event():
    """The fix: the compute stream waits for an event recorded on the loader stream after the upload."""
    _tile_filter(wait_for_load=True)


SCENARIOS = [
    linalg_inv_after_syncing_idle_stream, linalg_inv_after_device_sync,
    cusignal_stream_use_leaks_into_caller, cusignal_stream_scoped_with_block,
    cusignal_raw_kernel_on_stream_copies_on_default, cusignal_copies_on_user_stream,
    cuml_ptds_output_consumed_on_user_stream, cuml_ptds_synchronized_before_use,
    cufft_spectrum_used_on_other_stream, cufft_spectrum_after_wait_event,
    event_recorded_before_async_d2h, event_recorded_after_async_d2h,
    scratch_allocated_outside_stream_reused, scratch_allocated_on_its_stream,
    tile_filtered_before_upload, tile_filtered_after_wait_event,
]

EXPECTED = {
    "linalg_inv_after_syncing_idle_stream": [
        ("device-device", "default", "cupy.ndarray.__setitem__", "inv", "cupy.linalg.inv"),
    ],
    "linalg_inv_after_device_sync": [],
    "cusignal_stream_use_leaks_into_caller": [
        ("device-device", "kf0", "cupy.RawKernel:streamsan_kf_predict", "kf1", "cupy.ndarray.__add__"),
    ],
    "cusignal_stream_scoped_with_block": [],
    # (the upload is ordered: CuPy 14 waits on an event after copying pageable samples, as the H200 trace shows)
    "cusignal_raw_kernel_on_stream_copies_on_default": [
        ("device-device", "user", "cupy.RawKernel:streamsan_lombscargle", "default", "cupy.asnumpy"),  # RAW pgram
    ],
    "cusignal_copies_on_user_stream": [],
    "cuml_ptds_output_consumed_on_user_stream": [
        ("device-device", "per-thread default", "cupy.ndarray.__sub__", "user", "cupy.ndarray.__mul__"),
    ],
    "cuml_ptds_synchronized_before_use": [],
    "cufft_spectrum_used_on_other_stream": [
        ("device-device", "fft", "cupy.fft.rfft", "filter", "cupy.ndarray.__mul__"),
    ],
    "cufft_spectrum_after_wait_event": [],
    "event_recorded_before_async_d2h": [
        ("host-device", "d2h", "cupy.asnumpy", "host", "numpy.add.reduce"),
    ],
    "event_recorded_after_async_d2h": [],
    "scratch_allocated_outside_stream_reused": [
        ("missing-record-stream", "work", "cupy.ndarray.sum", "default", "allocation"),
    ],
    "scratch_allocated_on_its_stream": [],
    "tile_filtered_before_upload": [
        ("device-device", "load", "cupy.ndarray.set", "compute", "cupyx.scipy.ndimage.gaussian_filter"),
    ],
    "tile_filtered_after_wait_event": [],
}


test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED, tracer="cupy")
