"""Stream bugs of projects built on CuPy and of CuPy's boundary with other libraries, each as a small buggy program
and its fix.

Every pair reproduces the pattern of a real stream bug (named in the docstring: project, issue / PR, what raced) in
CuPy itself, in code built on it (cuQuantum Python, gpu4pyscf, Chainer) or at the boundary between CuPy and another
library (PyTorch through DLPack and ``__cuda_array_interface__``, Triton's Python backend, NVIDIA DALI, Numba's CUDA
Array Interface), with plain CuPy (and torch where the bug is an interop one): arrays of at most 1 << 16 elements,
no downloads, none of those projects' code. The buggy function must give exactly the findings in EXPECTED (kind,
previous stream role, previous op, current stream role, current op); the fixed one must give none.

Stream roles: "default" (the legacy default stream: CuPy's ``Stream.null``, torch's default stream), "host", and
the side streams each program names with streamsan.name_stream ("d2h", "compute", "user", "work", "cupy_side",
"torch_side", "h2d", "map0" / "map1" / "reduce", "transfer", "producer" / "consumer"). Side streams are
non-blocking unless the docstring says otherwise. Skipped without CUDA, torch (the shared conftest needs it) or
CuPy.
"""

import numpy
import torch

import streamsan
from streamsan.tracers.staging import WRITE_SEEN
from tests.gpu.support.scenario_kit import cupy_streams as streams
from tests.gpu.support.scenario_kit import need_cupy, scenario_tests

cupy, cupyx = need_cupy()

N = 1 << 16
F32 = numpy.float32


def device_sync():
    cupy.cuda.Device().synchronize()


# ------------------------------------------------------------------ D2H read-back of a result computed on a stream
def _contraction_readback(blocking):
    d2h, compute = streams("d2h", "compute")
    with compute:
        result = cupy.empty(N, dtype=F32)
        result.fill(1.0)  # the contraction writes its output on the caller's stream
    d2h.wait_event(compute.record())  # the read-back is ordered after the contraction
    host = cupyx.empty_pinned(N, dtype=F32)
    cupy.asnumpy(result, stream=d2h, out=host, blocking=blocking)
    value = host.sum()  # the host uses the result
    with compute:
        result[:] = 0.0  # and the next contraction overwrites the device output
    device_sync()
    del value


def cuquantum_async_d2h_read_early():
    """Models cupy/cupy#7820 (closed by cupy/cupy#7938): ``ndarray.get()`` / ``cupy.asnumpy()`` on a stream
    returned before the device-to-host copy had run. CuPy's maintainers hit it in NVIDIA cuQuantum Python
    (cutensornet's tensor_network.py reading a contraction result back inside ``with stream:``) and sketched the
    device side in the review of cupy/cupy#5155 (``with stream1: asnumpy(a)``, then ``with stream2: a[:] = 0``).
    Today that behaviour is spelled ``blocking=False``: the host reads the pinned result and the compute stream
    overwrites the device array while the copy may still run."""
    _contraction_readback(blocking=False)


def cuquantum_blocking_d2h():
    """The fix of cupy/cupy#7938: D2H copies are blocking by default, so the host, and the work it enqueues
    afterwards, come after the copy."""
    _contraction_readback(blocking=True)


# ------------------------------------------------------------------ library kernels on the default stream
PYSCF_VJ = r'''
extern "C" __global__ void streamsan_pyscf_vj(const float* dm, float* vj, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) vj[i] = 2.0f * dm[i];
}
'''


def _scf_under_stream(non_blocking):
    (user,) = streams("user", non_blocking=non_blocking)
    vj_kernel = streamsan.cupy_access(cupy.RawKernel(PYSCF_VJ, "streamsan_pyscf_vj"), reads=("dm",),
                                      writes=("vj",))
    with user:  # the caller runs the whole SCF under a stream of its own
        dm = cupy.empty(N, dtype=F32)
        dm.fill(0.5)  # CuPy work follows the current stream
        vj = cupy.empty(N, dtype=F32)
        # the library's own kernel is launched on the default stream, as its kernels assume
        vj_kernel((N // 256,), (256,), (dm, vj, numpy.int32(N)), stream=cupy.cuda.Stream.null)
        energy = vj.sum()  # back in CuPy, on the caller's stream
    device_sync()
    del energy


def gpu4pyscf_kernels_on_default_stream():
    """Models pyscf/gpu4pyscf#893 (DF-RKS energies off by thousands of Hartree, no error, when run under a
    ``non_blocking=True`` CuPy stream; the maintainers: most of its CUDA kernels assume the default stream): the
    density matrix is written on the caller's non-blocking stream, the library's kernel reads it and writes
    ``vj`` on the legacy default stream, and CuPy reads ``vj`` back on the caller's stream; a non-blocking stream
    is ordered with neither."""
    _scf_under_stream(non_blocking=True)


def gpu4pyscf_blocking_user_stream():
    """The workaround the report of pyscf/gpu4pyscf#893 measured as exact: a blocking stream
    (``non_blocking=False``, CuPy's default), which CUDA orders with the legacy default stream both ways."""
    _scf_under_stream(non_blocking=False)


# ------------------------------------------------------------------ a D2D copy on the legacy stream
def _copy_then_use(legacy_copy):
    (work,) = streams("work")
    with work:
        src = cupy.empty(N, dtype=F32)
        src.fill(1.0)
        dst = cupy.empty(N, dtype=F32)
        if legacy_copy:
            # what ndarray.copy() / cupy.asarray() did before cupy/cupy#5004: cudaMemcpy, on the legacy stream
            cupy.cuda.runtime.memcpy(dst.data.ptr, src.data.ptr, src.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice)
        else:
            cupy.copyto(dst, src)  # cudaMemcpyAsync on the current stream
        out = dst * 2.0
    device_sync()
    del out


def cupy_copy_on_legacy_stream():
    """Models cupy/cupy#4988 ("asarray Ignores the Current Stream", fixed by cupy/cupy#5004; the same bug in
    ``copyto`` was cupy/cupy#2159): a device-to-device copy made with ``cudaMemcpy`` runs on the legacy default
    stream while the program works on a non-blocking stream, so the copy may read its source before the stream's
    write, and the stream's next kernel may read the destination before the copy (the reporters' multi-GPU
    application worked around it by hand, ut-parla/Parla.py#41)."""
    _copy_then_use(legacy_copy=True)


def cupy_copy_on_current_stream():
    """The fix of cupy/cupy#5004: the copy is a ``cudaMemcpyAsync`` on the current stream (here ``cupy.copyto``),
    in order with the stream's other work."""
    _copy_then_use(legacy_copy=False)


# ------------------------------------------------------------------ CuPy -> torch: CUDA Array Interface vs DLPack
def _cupy_to_torch(via):
    (cs,) = streams("cupy_side")
    with cs:
        x = cupy.arange(N, dtype=F32)  # produced on CuPy's stream
        if via == "cai":
            t = torch.as_tensor(x, device="cuda")  # the interface names cs as its stream; torch does not wait
        else:
            t = torch.from_dlpack(x)  # x.__dlpack__(stream=torch's current stream): that stream waits for cs
    t.mul_(2.0)  # torch's current stream: the default stream
    torch.cuda.synchronize()


def dali_style_cai_consumer_ignores_stream():
    """Models NVIDIA/DALI#5125 ("Fix constructing tensors from __cuda_array_interface__ v3": the consumer assumed
    the data were ready and ignored the interface's ``stream``; it showed with CuPy producers), with PyTorch as the
    consumer: ``torch.as_tensor`` of a CuPy array wraps the pointer (tensor_from_cuda_array_interface reads no
    ``stream`` key), so torch's stream writes the array while CuPy's stream may still be producing it. The rule
    the consumer breaks is CAI v3's (numba/numba#5162)."""
    _cupy_to_torch("cai")


def torch_from_dlpack_waits_cupy_stream():
    """The fix, through DLPack: ``torch.from_dlpack`` hands torch's current stream to ``__dlpack__`` and CuPy
    makes that stream wait for its own current stream (an event record + wait) before the pointer changes hands,
    the ordering DALI#5125 established by honouring the interface's stream."""
    _cupy_to_torch("dlpack")


# ------------------------------------------------------------------ torch -> CuPy: DLPack from a side stream
def _torch_to_cupy(join_producer):
    ts = torch.cuda.Stream()
    streamsan.name_stream(ts, "torch_side")
    (cs,) = streams("cupy_side")
    t = torch.empty(N, device="cuda")
    ts.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(ts):
        t.fill_(2.0)  # the model writes its output on a side stream
    if join_producer:
        torch.cuda.current_stream().wait_stream(ts)
    with cs:
        x = cupy.from_dlpack(t)  # t.__dlpack__(stream=cs): cs waits for torch's *current* stream only
        y = x * 3.0
    device_sync()
    del y


def triton_dlpack_from_side_stream():
    """Models the race behind triton-inference-server/python_backend#223 and #243 (tested by
    triton-inference-server/server#5550: a tensor written under ``torch.cuda.stream(s1)`` and handed over with
    DLPack): the producer's ``__dlpack__(stream=consumer)`` orders the consumer after the producer's *current*
    stream, not after the side stream that wrote the tensor, so the CuPy consumer reads it early."""
    _torch_to_cupy(join_producer=False)


def triton_dlpack_side_stream_joined():
    """The fix: the writing stream is joined into torch's current stream before the hand-off, so the event that
    ``__dlpack__`` records covers the write (python_backend#223 / #243 synchronized the device or the default
    stream in ``from_dlpack`` instead)."""
    _torch_to_cupy(join_producer=True)


# ------------------------------------------------------------------ a pinned staging buffer refilled during H2D
def _staged_upload(wait_before_refill):
    (h2d,) = streams("h2d")
    staging = cupyx.empty_pinned(N, dtype=F32)
    uploaded = cupy.cuda.Event()
    sums = []
    for step in range(3):
        if wait_before_refill and step:
            uploaded.synchronize()  # the previous upload has read the staging buffer
        staging[:] = step + 1.0  # the reader fills the pinned staging buffer with the next chunk
        with h2d:
            chunk = cupy.empty(N, dtype=F32)
            chunk.set(staging)  # asynchronous H2D straight from pinned memory
            uploaded.record()
            sums.append(chunk.sum())
    device_sync()
    del sums


def pinned_staging_refilled_during_h2d():
    """Models the hazard of cupy/cupy#8789 (a pinned source reused while CuPy's asynchronous H2D copy from it was
    still pending; the reporter spent days chasing it) in its refill form, the one the review of cupy/cupy#5155
    pointed out (``arr_cpu[:] = 0  # this may run during HtoD``) and the ``blocking=`` documentation added to
    ``cupy.array`` by cupy/cupy#7939 warns about: a persistent pinned staging buffer is refilled for chunk N+1
    while chunk N's copy may still read it."""
    _staged_upload(wait_before_refill=False)


def pinned_staging_refilled_after_event():
    """The fix: an event recorded after each upload and synchronized before the host refills the buffer (CuPy's
    own fix, cupy/cupy#8845, holds the sources it copies from until the copy's event has completed)."""
    _staged_upload(wait_before_refill=True)


# ------------------------------------------------------------------ map-reduce over CuPy's per-stream pool
R = 128  # 128 x 128 float32 matrices: 1 << 14 elements


def _map_reduce_round(maps, reduce_stream, w, total, value):
    parts = []
    for s in maps:
        with s:
            x = cupy.empty((R, R), dtype=F32)  # allocated from this map stream's arena
            x.fill(value)
            parts.append(x @ w)  # the partial result, also from this map stream's arena
    for s in maps:
        reduce_stream.wait_event(s.record())
    with reduce_stream:
        for p in parts:
            total += p  # the reduce stream reads every partial result
    # returning drops the partial results: their blocks go back to the map streams' arenas


def _map_reduce(wait_for_reduce):
    maps = streams("map0", "map1", non_blocking=False)  # CuPy's default (blocking) streams, as in the example
    (reduce_stream,) = streams("reduce", non_blocking=False)
    w = cupy.empty((R, R), dtype=F32)
    w.fill(1.0 / R)  # the null stream: blocking streams run after it
    with reduce_stream:
        total = cupy.zeros((R, R), dtype=F32)
    for rnd in range(2):
        if wait_for_reduce and rnd:
            reduced = reduce_stream.record()
            for s in maps:
                s.wait_event(reduced)  # the map streams allocate again only after the reduction
        _map_reduce_round(maps, reduce_stream, w, total, rnd + 1.0)
    device_sync()


def map_reduce_partials_reused_early():
    """Models the hazard of cupy/cupy#8068 (open: CuPy's memory pool keeps one arena per stream and has no
    ``record_stream``, so memory allocated on stream A and used by a kernel on stream B may be handed out again by
    A as soon as the array is dropped) in the shape of CuPy's examples/stream/map_reduce.py run for two rounds:
    each map stream's partial result is reduced on the reduce stream and dropped, and the map stream's next
    round allocates before the reduction is known to be done. Streams are CuPy's default blocking ones: they are
    ordered with the null stream, not with each other."""
    _map_reduce(wait_for_reduce=False)


def map_reduce_waits_for_reduce():
    """The remedy CuPy's maintainers give in cupy/cupy#8068: declare the order with ``Stream.wait_event`` (the map
    streams wait for an event recorded on the reduce stream before allocating again)."""
    _map_reduce(wait_for_reduce=True)


# ------------------------------------------------------------------ Chainer's asynchronous batch transfer
class _Conveyor:
    """chainer.dataset.convert.Conveyor, reduced: double-buffered pinned and device arrays; ``put`` copies a batch
    into pinned memory on the host and sends it to the GPU on the transfer stream; ``get`` is ``get(sync=False)``
    (the caller orders its use of the batch)."""

    def __init__(self, stream):
        self.stream = stream
        self.slots = [[None, None], [None, None]]
        self.ready = []

    def put(self, batch):
        pinned, dev = self.slots.pop(0)
        if pinned is None:
            cupy.cuda.runtime.deviceSynchronize()  # Chainer's guard before a slot is allocated
            mem = cupy.cuda.alloc_pinned_memory(batch.nbytes)
            pinned = numpy.frombuffer(mem, batch.dtype, batch.size).reshape(batch.shape)
            dev = cupy.empty(batch.shape, batch.dtype)
        pinned[...] = batch  # pageable -> pinned on the host, through a plain NumPy view
        dev.set(pinned, self.stream)  # pinned -> device on the transfer stream
        self.slots.append([pinned, dev])
        self.ready.append(dev)

    def get(self):
        return self.ready.pop(0)


def _async_transfer_training(with_events):
    (transfer,) = streams("transfer")
    compute = cupy.cuda.Stream.null  # ConcatWithAsyncTransfer(compute_stream=Stream.null), as Chainer documents
    conveyor = _Conveyor(transfer)
    event1, event2 = cupy.cuda.Event(), cupy.cuda.Event()
    w = cupy.empty((64, 256), dtype=F32)
    w.fill(0.5)
    loss = None
    for i in range(4):
        batch = numpy.full((64, 256), i + 1.0, dtype=F32)
        if with_events:
            event1.synchronize()  # the compute work that used this slot two batches ago is done
            event1.record(compute)
        conveyor.put(batch)
        x = conveyor.get()
        if with_events:
            event2.record(transfer)
            compute.wait_event(event2)  # the step reads the batch only after its transfer
        loss = (x * w).sum()  # the training step, on the compute stream
    device_sync()
    del loss


def chainer_async_transfer_without_events():
    """Models what chainer/chainer#5606 ("Overlap compute and transfer more") had to add to
    ``ConcatWithAsyncTransfer`` when it dropped the global synchronizations of chainer/chainer#3336: with
    ``Conveyor.get(sync=False)`` the compute stream must wait for the transfer stream (``event2``), and a
    double-buffered slot must not be refilled while the compute stream may still read it (``event1``). Without
    the events the training step reads a batch that may still be in transfer, and the transfer of batch N+2
    overwrites the device slot batch N's step may still read. The host's refill of the pinned slot races as well:
    it writes through a plain NumPy view of ``alloc_pinned_memory``, which streamsan finds by the bytes it changed
    when the slot is sent again."""
    _async_transfer_training(with_events=False)


def chainer_async_transfer_with_events():
    """chainer/chainer#5606's scheme: ``event1`` is synchronized before a slot is refilled and re-recorded on the
    compute stream; ``event2`` is recorded on the transfer stream and waited for by the compute stream."""
    _async_transfer_training(with_events=True)


# ------------------------------------------------------------------ CUDA Array Interface: v2 vs v3 producers
class _ExportedBuffer:
    """Device memory of another library handed to CuPy through the CUDA Array Interface (a Numba
    DeviceNDArray, a cuDF buffer...). ``stream``: the stream its data are produced on, exported as CAI v3's
    ``stream`` key; None for a v2-style export that names no stream."""

    def __init__(self, array, stream):
        self._array = array
        self._stream = stream

    @property
    def __cuda_array_interface__(self):
        a = self._array
        iface = {"shape": a.shape, "typestr": a.dtype.str, "data": (a.data.ptr, False), "strides": None,
                 "version": 2}
        if self._stream is not None:
            iface["version"] = 3
            iface["stream"] = self._stream.ptr
        return iface


def _cai_handoff(export_stream):
    producer, consumer = streams("producer", "consumer")
    with producer:
        data = cupy.empty(N, dtype=F32)
        data.fill(4.0)  # the producing library writes on its own stream
    buf = _ExportedBuffer(data, producer if export_stream else None)
    with consumer:
        x = cupy.asarray(buf)  # zero-copy; CuPy synchronizes the stream the interface names, if any
        y = x * 2.0
    device_sync()
    del y


def cai_v2_producer_names_no_stream():
    """Models the gap numba/numba#4933 discussed and numba/numba#5162 closed (CUDA Array Interface v3: a producer
    exports the stream its data are produced on, and a consumer synchronizes it), which CuPy adopted in
    cupy/cupy#4357: a producer that exports memory still being written on its own stream through a v2-style
    interface, with no ``stream`` key, lets CuPy wrap and read it at once."""
    _cai_handoff(export_stream=False)


def cai_v3_producer_exports_stream():
    """The CAI v3 export: the interface names the producing stream, and ``cupy.asarray`` synchronizes it before
    it wraps the pointer (``CUPY_CUDA_ARRAY_INTERFACE_SYNC``, on by default)."""
    _cai_handoff(export_stream=True)


SCENARIOS = [
    cuquantum_async_d2h_read_early, cuquantum_blocking_d2h,
    gpu4pyscf_kernels_on_default_stream, gpu4pyscf_blocking_user_stream,
    cupy_copy_on_legacy_stream, cupy_copy_on_current_stream,
    dali_style_cai_consumer_ignores_stream, torch_from_dlpack_waits_cupy_stream,
    triton_dlpack_from_side_stream, triton_dlpack_side_stream_joined,
    pinned_staging_refilled_during_h2d, pinned_staging_refilled_after_event,
    map_reduce_partials_reused_early, map_reduce_waits_for_reduce,
    chainer_async_transfer_without_events, chainer_async_transfer_with_events,
    cai_v2_producer_names_no_stream, cai_v3_producer_exports_stream,
]

EXPECTED = {
    "cuquantum_async_d2h_read_early": [
        ("host-device", "d2h", "cupy.asnumpy", "host", "numpy.add.reduce"),  # the host reads the result
        ("device-device", "d2h", "cupy.asnumpy", "compute", "cupy.ndarray.__setitem__"),  # WAR on the output
    ],
    "cuquantum_blocking_d2h": [],
    "gpu4pyscf_kernels_on_default_stream": [
        ("device-device", "user", "cupy.ndarray.fill", "default", "cupy.RawKernel:streamsan_pyscf_vj"),
        ("device-device", "default", "cupy.RawKernel:streamsan_pyscf_vj", "user", "cupy.ndarray.sum"),
    ],
    "gpu4pyscf_blocking_user_stream": [],
    "cupy_copy_on_legacy_stream": [
        ("device-device", "work", "cupy.ndarray.fill", "default", "cupy.cuda.runtime.memcpy"),
        ("device-device", "default", "cupy.cuda.runtime.memcpy", "work", "cupy.ndarray.__mul__"),
    ],
    "cupy_copy_on_current_stream": [],
    "dali_style_cai_consumer_ignores_stream": [
        ("device-device", "cupy_side", "cupy.arange", "default", "aten::mul_.Tensor"),
    ],
    "torch_from_dlpack_waits_cupy_stream": [],
    "triton_dlpack_from_side_stream": [
        ("device-device", "torch_side", "aten::fill_.Scalar", "cupy_side", "cupy.ndarray.__mul__"),
    ],
    "triton_dlpack_side_stream_joined": [],
    "pinned_staging_refilled_during_h2d": [
        ("host-device", "h2d", "cupy.ndarray.set", "host", "numpy.ndarray.__setitem__"),
    ],
    "pinned_staging_refilled_after_event": [],
    "map_reduce_partials_reused_early": [
        ("missing-record-stream", "reduce", "cupy.ndarray.__iadd__", "map0", "allocation"),
    ],
    "map_reduce_waits_for_reduce": [],
    "chainer_async_transfer_without_events": [
        ("device-device", "transfer", "cupy.ndarray.set", "default", "cupy.ndarray.__mul__"),  # RAW on the batch
        ("host-device", "transfer", "cupy.ndarray.set", "host", WRITE_SEEN),  # the refill of the pinned slot
        ("device-device", "default", "cupy.ndarray.__mul__", "transfer", "cupy.ndarray.set"),  # WAR on the slot
    ],
    "chainer_async_transfer_with_events": [],
    "cai_v2_producer_names_no_stream": [
        ("device-device", "producer", "cupy.ndarray.fill", "consumer", "cupy.ndarray.__mul__"),
    ],
    "cai_v3_producer_exports_stream": [],
}


test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED, tracer="cupy")
