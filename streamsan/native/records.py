"""The native observer's drained records and their decoding (needs no torch: it can run off the program's thread).

``observer.drain()`` gives packed little-endian buffers (records, tensors, dims, events) and the op names and call
sites first met since the previous drain; a :class:`Decoder` keeps those tables across drains and turns each drain
into :class:`Record` and :class:`Event` tuples in sequence order. ``LAYOUT`` must equal the extension's.
"""

from __future__ import annotations

import gc
import struct
from typing import NamedTuple

LAYOUT = "records-1:60:40:36"
_RECORD = struct.Struct("<QQQQqIIIHHHbb")
_TENSOR = struct.Struct("<QqQIhhbbbbBBBx")
_EVENT = struct.Struct("<QQQQBbbx")

# Record flags. The first three: the record is not what the dispatch mode sees (something took the op before the
# mode would have), and its children (records whose parent is its seq) are; the others: it is the mode's view,
# but the Python path must handle it.
AUTOCAST = 1  # an autocast kernel casts the inputs and calls the op again
TRANSFORM = 2  # functorch, functionalization, JIT tracing, the Python dispatcher or a lazy conj/neg/zero tensor
MODE_ABOVE = 4  # a dispatch mode pushed after start() takes the op first
SUBCLASS = 8  # a tensor carries the Python key (a subclass, a fake or functional tensor)
MULTI_DEVICE = 16  # tensors on several accelerator devices: the stream is the first one's
NO_OUTPUTS = 32  # the op raised: no outputs recorded
NOT_THE_MODES_VIEW = AUTOCAST | TRANSFORM | MODE_ABOVE
NEEDS_PYTHON = NOT_THE_MODES_VIEW | SUBCLASS | MULTI_DEVICE

# Tensor flags.
PYTHON_KEY, NO_STORAGE, NO_LAYOUT, CONJ, NEG = 1, 2, 4, 8, 16

# Event kinds: PyTorch's GPU-trace callbacks.
EVENT_CREATE, EVENT_DELETE, EVENT_RECORD, EVENT_WAIT, ALLOC, FREE, STREAM_CREATE, DEVICE_SYNC, STREAM_SYNC, \
    EVENT_SYNC = range(1, 11)

# c10 ScalarType names (as the extension's scalar_type_names() gives them) -> torch dtype names
_DTYPES = {"Byte": "uint8", "Char": "int8", "Short": "int16", "Int": "int32", "Long": "int64", "Half": "float16",
           "Float": "float32", "Double": "float64", "ComplexHalf": "complex32", "ComplexFloat": "complex64",
           "ComplexDouble": "complex128", "Bool": "bool", "QInt8": "qint8", "QUInt8": "quint8", "QInt32": "qint32",
           "BFloat16": "bfloat16", "QUInt4x2": "quint4x2", "QUInt2x4": "quint2x4", "Float8_e5m2": "float8_e5m2",
           "Float8_e4m3fn": "float8_e4m3fn", "Float8_e5m2fnuz": "float8_e5m2fnuz",
           "Float8_e4m3fnuz": "float8_e4m3fnuz", "UInt16": "uint16", "UInt32": "uint32", "UInt64": "uint64"}


class Tensor(NamedTuple):
    arg: int  # schema argument position; outputs: -1 - k
    item: int  # position in a tensor list, else -1
    data: int  # storage data pointer (0: none)
    offset: int  # storage offset in bytes
    storage_nbytes: int
    dtype: str  # torch's name ("float32"), or the c10 name where torch has none
    device_type: int  # c10::DeviceType (0 CPU, 1 CUDA); -1 unknown
    device_index: int
    layout: int  # c10::Layout (0 strided); -1 unknown
    itemsize: int
    sizes: tuple
    strides: tuple
    flags: int

    @property
    def is_output(self) -> bool:
        return self.arg < 0


class Record(NamedTuple):
    seq: int
    end: int  # the next sequence number when the op ended: its own events are its thread's in (seq, end)
    thread: int
    parent: int  # seq of the enclosing record that is not the mode's view, or 0
    name: str  # "aten::add_"
    overload: str  # "Tensor" ("" for the default overload)
    flags: int
    stream: tuple | None  # (device type, device index, c10 stream id) of the op's device, or None
    site: tuple  # ((code object, instruction offset in bytes), ...), innermost first; () without Python frames
    inputs: tuple  # of Tensor
    outputs: tuple  # of Tensor


class Event(NamedTuple):
    seq: int
    thread: int
    kind: int
    device_type: int
    device_index: int  # the current device (ALLOC, DEVICE_SYNC), else -1
    a: int  # pointer or event
    b: int  # stream (EVENT_RECORD, EVENT_WAIT), else 0


class Decoder:
    """Decodes drains of one observer: the op and site tables (``tables``: those met before it was made) grow with
    each drain."""

    def __init__(self, scalar_type_names=(), tables=((), ())):
        self.dtypes = tuple(_DTYPES.get(n, n) for n in scalar_type_names)
        self.ops: dict[int, tuple[str, str]] = {}
        self.sites: dict[int, tuple] = {0: ()}
        self._learn(*tables)

    def _learn(self, ops, sites) -> None:
        for op_id, name, overload in ops:
            self.ops[op_id] = (name, overload)
        for site_id, frames in sites:
            self.sites[site_id] = frames

    def decode(self, drained) -> tuple[list[Record], list[Event]]:
        # (the cyclic collector would scan the growing lists again and again: nothing made here has a cycle)
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._decode(drained)
        finally:
            if enabled:
                gc.enable()

    def _decode(self, drained):
        records_raw, tensors_raw, dims_raw, events_raw, ops, sites = drained
        self._learn(ops, sites)
        dims = struct.unpack(f"<{len(dims_raw) // 8}q", dims_raw)
        tensors = [self._tensor(t, dims) for t in _TENSOR.iter_unpack(tensors_raw)]
        records = []
        for (seq, end, thread, parent, stream, op, site, first, n_in, n_out, flags, sdt, sdi) in \
                _RECORD.iter_unpack(records_raw):
            name, overload = self.ops[op]
            records.append(Record(seq, end, thread, parent, name, overload, flags,
                                  (sdt, sdi, stream) if sdt >= 0 else None, self.sites[site],
                                  tuple(tensors[first:first + n_in]),
                                  tuple(tensors[first + n_in:first + n_in + n_out])))
        events = [Event(seq, thread, kind, dt, di, a, b) for seq, thread, a, b, kind, dt, di in
                  _EVENT.iter_unpack(events_raw)]
        records.sort(key=lambda r: r.seq)
        events.sort(key=lambda e: e.seq)
        return records, events

    def _tensor(self, t, dims) -> Tensor:
        data, offset, nbytes, dims_first, arg, item, dtype, dev_type, dev_index, layout, ndim, itemsize, flags = t
        sizes = dims[dims_first:dims_first + ndim]
        strides = dims[dims_first + ndim:dims_first + 2 * ndim]
        name = self.dtypes[dtype] if 0 <= dtype < len(self.dtypes) else str(dtype)
        return Tensor(arg, item, data, offset, nbytes, name, dev_type, dev_index, layout, itemsize, sizes, strides,
                      flags)


def byte_range(t: Tensor):
    """The bytes a strided tensor's kernel may touch, as the torch tracer's ranges give them: (start, nbytes) when
    its elements cover their extent densely, else (start, extent, (itemsize, sizes, strides)); None when empty or
    not strided memory."""
    if t.flags & (NO_STORAGE | NO_LAYOUT) or not t.data:
        return None
    numel = 1
    for s in t.sizes:
        numel *= s
    n = numel * t.itemsize
    if n == 0:
        return None
    start = t.data + t.offset
    extent = 1
    dense = True
    for sz, st in zip(t.sizes, t.strides):
        if sz > 1:
            if st == 0:
                dense = False
            extent += (sz - 1) * st
    extent *= t.itemsize
    if dense and extent == n:
        return (start, n)
    return (start, extent, (t.itemsize, tuple(t.sizes), tuple(t.strides)))
