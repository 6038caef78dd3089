"""Stream bugs of data loading, GPU preprocessing and output pipelines, each as a small buggy program and its fix.

Where batches enter and predictions leave the GPU: a ``DataLoader(pin_memory=True)`` batch edited on the host while
its non-blocking copy may still read it (albanD's demonstration in pytorch/pytorch#127612, the note
pytorch/tutorials#3261 added to the pin-memory tutorial); a ring of pinned staging slots; a video decoder's frames
handed to a color converter on another stream (meta-pytorch/torchcodec#868: the converter did not wait for the
decoder; meta-pytorch/torchcodec#1651: the decoder's stream could reclaim a frame the converter still read); pinned
prediction buffers the host reads after a wait made on a stream instead of on the host (the distinction
NVIDIA/DALI#5820 drew between host-awaited and stream-awaited readiness events); a device-to-host copy into pinned
memory read too early (pytorch/pytorch#86264, PTB-MR/mrpro#984) next to the same copy into pageable memory, which CUDA
completes before returning (pytorch/pytorch#39694 quotes the rule); a prefetch into a fixed input buffer that waits
for the forward pass but not for the backward pass that reads the input again; and ``Tensor.pin_memory()``, which
copies a pageable tensor but returns a pinned one itself (pytorch/pytorch#21076). The pairs that name no issue are
common patterns, named for what they do.

Races are decided by happens-before, not timing: each buggy program is reported even when the GPU happens to finish
first. Every program is plain PyTorch with tensors of at most 1 << 16 elements, single-threaded and deterministic.

EXPECTED maps each scenario to the (kind, previous stream role, previous op, current stream role, current op) tuples
that docs/semantics.md implies, in the order streamsan reports them (by the previous access's position in the trace,
then the current one's); fixed programs expect ``[]``. A racing pair that repeats at the same two call sites is one
finding with a count. Stream roles: "default" (the current stream), "host", and the side streams each program names
("copy", "decode", "convert", "d2h").
"""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from tests.gpu.support.scenario_kit import scenario_tests, streams



# ------------------------------------------------------------------ DataLoader batch edited on the host during H2D
def _loader_epoch(edit_a_clone):
    """A training loop over ``DataLoader(pin_memory=True)`` (num_workers=0: the batch is pinned in this thread): the
    batch goes to the GPU with ``.cuda(non_blocking=True)``, and the loop keeps a de-normalized copy of the CPU
    batch for a preview grid. ``edit_a_clone``: the de-normalization runs on a clone, not on the pinned batch."""
    n, d, mean, std = 12, 4096, 0.5, 0.25
    images = torch.arange(n * d, dtype=torch.float32).view(n, d) / (n * d)
    labels = torch.arange(n) % 10
    loader = DataLoader(TensorDataset(images, labels), batch_size=4, pin_memory=True)
    w = torch.full((d, 10), 0.01, device="cuda")
    previews = []
    for x, y in loader:  # pinned host batches
        xg = x.cuda(non_blocking=True)
        yg = y.cuda(non_blocking=True)
        loss = F.cross_entropy(torch.mm(xg, w), yg)
        shown = x.clone() if edit_a_clone else x
        previews.append(shown.mul_(std).add_(mean))  # de-normalize for the preview grid
        del loss
    torch.cuda.synchronize()


def dataloader_batch_denormalized_during_h2d():
    """The host de-normalizes the pinned batch in place right after ``.cuda(non_blocking=True)``: the copy may still
    be reading it, so the GPU can train on the edited values (albanD's demonstration in pytorch/pytorch#127612:
    "the CPU Tensor was modified before its data were sent to the gpu"; pytorch/tutorials#3261: "mutating the
    original copy after calling the host-to-device transfer may corrupt the data received on GPU")."""
    _loader_epoch(edit_a_clone=False)


def dataloader_batch_denormalized_on_clone():
    """Fixed: the preview is made from a clone; the pinned batch the copy reads is only read on the host."""
    _loader_epoch(edit_a_clone=True)


# ------------------------------------------------------------------ a ring of pinned staging slots
def _staging_ring(sync_before_refill):
    """A loader collates each batch into one of two pinned staging slots and copies it to the GPU on its copy stream,
    recording the slot's event after the copy; the default stream waits for the copy stream and trains on the batch
    (recorded on the default stream). Before reusing a slot the loader synchronizes the slot's event: before the
    refill (the fix), or after it, just before the copy (the bug)."""
    (copy,) = streams("copy")
    slots, steps, b, d = 2, 5, 64, 256
    data = torch.arange(16 * d, dtype=torch.float32).view(16, d)  # the in-memory dataset (pageable)
    ring = [torch.empty(b, d, pin_memory=True) for _ in range(slots)]
    copied = [torch.cuda.Event() for _ in range(slots)]
    w = torch.full((d, 16), 0.01, device="cuda")
    cur = torch.cuda.current_stream()
    outs = []
    for step in range(steps):
        k = step % slots
        if sync_before_refill and step >= slots:
            copied[k].synchronize()  # the copy that last read this slot is done
        idx = torch.arange(step, step + b) % data.shape[0]
        ring[k].copy_(data[idx])  # collate the batch into the pinned slot
        if not sync_before_refill and step >= slots:
            copied[k].synchronize()  # too late: the refill above already overwrote the slot
        with torch.cuda.stream(copy):
            batch = ring[k].to("cuda", non_blocking=True)
            copied[k].record()
        cur.wait_stream(copy)
        batch.record_stream(cur)
        outs.append(torch.mm(batch, w))
    torch.cuda.synchronize()


def staging_ring_synchronized_after_refill():
    """The slot's event is synchronized between the refill and the copy (where the copy seems to need it): the refill
    of slot k overwrites the bytes the copy stream's copy of two steps before may still be reading (write after
    read)."""
    _staging_ring(sync_before_refill=False)


def staging_ring_synchronized_before_refill():
    """Fixed: the slot's event is synchronized before the host refills the slot."""
    _staging_ring(sync_before_refill=True)


# ------------------------------------------------------------------ video decode, then color conversion on GPU
H = W = 64
NV12 = H * W * 3 // 2  # bytes of one 64x64 NV12 frame


def _packets(n):
    """n frames' worth of pinned host bytes (what the decoder consumes)."""
    return [torch.full((NV12,), 16 + 32 * i, dtype=torch.uint8).pin_memory() for i in range(n)]


def _to_rgb(surface):
    """The color conversion (NPP's, reduced to the luma plane): an NV12 surface in, a float image out."""
    luma = surface[: H * W].view(H, W)
    return luma.sub(16.0).mul_(255.0 / 219.0)


def _nvdec_to_npp(wait_for_decoder):
    """torchcodec's CUDA decoding, reduced: NVDEC writes each frame's NV12 surface on the decoder stream, NPP converts
    it to RGB on the caller's (current) stream."""
    (decode,) = streams("decode")
    cur = torch.cuda.current_stream()
    packets = _packets(3)
    surfaces = torch.empty(len(packets), NV12, dtype=torch.uint8, device="cuda")  # the decoder's output surfaces
    decode.wait_stream(cur)
    frames = []
    for i, packet in enumerate(packets):
        with torch.cuda.stream(decode):
            surfaces[i].copy_(packet, non_blocking=True)  # NVDEC writes the frame's surface
        if wait_for_decoder:
            cur.wait_stream(decode)
        frames.append(_to_rgb(surfaces[i]))
    torch.cuda.synchronize()


def torchcodec_convert_without_decoder_wait():
    """Models the bug meta-pytorch/torchcodec#868 fixes ("Fix NVDEC -> NPP CUDA stream sync issue"): with the decoder
    on a stream of its own, the NPP kernel could be launched "while the NVDEC stream hasn't actually finished
    decoding the frame" (read after write)."""
    _nvdec_to_npp(wait_for_decoder=False)


def torchcodec_convert_waits_for_decoder():
    """The fix of meta-pytorch/torchcodec#868: the NPP stream waits for the NVDEC stream before converting."""
    _nvdec_to_npp(wait_for_decoder=True)


def _decoder_and_converter(record):
    """A packet decoder allocates each decoded frame on its own stream and hands it to a color converter running on
    another stream, which waits for the decoder (torchcodec#868's edge); the decoder then drops the frame, and its
    next frame is allocated from the decoder stream's pool. ``record``: the frame is recorded on the converter's
    stream before it is dropped."""
    decode, convert = streams("decode", "convert")
    frames = []
    for packet in _packets(4):
        with torch.cuda.stream(decode):
            surface = packet.to("cuda", non_blocking=True)  # the decoded frame, from the decoder stream's pool
        convert.wait_stream(decode)
        with torch.cuda.stream(convert):
            frames.append(_to_rgb(surface))
        if record:
            surface.record_stream(convert)
        del surface  # the decoder releases the frame
    torch.cuda.current_stream().wait_stream(convert)
    torch.cuda.synchronize()


def torchcodec_frame_released_without_record_stream():
    """Models the bug meta-pytorch/torchcodec#1651 fixes ("Fix silent frame corruption when a ColorConverter runs on
    its own CUDA stream"): nothing guarded against "the decoder's stream reclaiming the CUDA memory of the allocated
    frames before the color-converter kernel has finished working on them"; the decoder's next allocation may be
    handed the block the converter may still read."""
    _decoder_and_converter(record=False)


def torchcodec_frame_recorded_on_convert_stream():
    """The fix of meta-pytorch/torchcodec#1651: ``record_stream()`` on the converter's stream before the frame is
    released."""
    _decoder_and_converter(record=True)


# ------------------------------------------------------------------ predictions copied into a pinned ring
def _prediction_writer(host_waits):
    """A prediction writer, one step behind the model: each step's predicted ids are copied on the d2h stream into a
    slot of a pinned ring (the GPU tensor recorded on d2h), with the slot's event recorded after the copy; the host
    then writes out the previous step's slot. Before reading it the writer waits for the slot's event: on the host
    (``event.synchronize()``, the fix) or with ``current_stream().wait_event(event)``, which makes a stream wait and
    returns at once (the bug)."""
    (d2h,) = streams("d2h")
    slots, steps, b, d, v = 2, 4, 128, 64, 512
    x = torch.full((b, d), 0.5, device="cuda")
    w = torch.linspace(-1.0, 1.0, d * v, device="cuda").view(d, v)
    ring = torch.empty(slots, b, dtype=torch.int64, pin_memory=True)
    ready = [torch.cuda.Event() for _ in range(slots)]
    cur = torch.cuda.current_stream()
    written = []
    pending = None
    for step in range(steps):
        k = step % slots
        pred = torch.mm(x * (step + 1), w).argmax(dim=-1)
        d2h.wait_stream(cur)
        with torch.cuda.stream(d2h):
            ring[k].copy_(pred, non_blocking=True)
            ready[k].record()
        pred.record_stream(d2h)
        if pending is not None:
            if host_waits:
                ready[pending].synchronize()
            else:
                cur.wait_event(ready[pending])  # orders the current stream; the host goes on at once
            written.append(ring[pending].tolist())
        pending = k
    ready[pending].synchronize()
    written.append(ring[pending].tolist())
    torch.cuda.synchronize()


def prediction_ring_read_after_stream_wait():
    """The writer makes the current stream wait for the slot's event and reads the slot on the host: nothing has
    made the host wait for the copy (the host-awaited vs stream-awaited distinction of NVIDIA/DALI#5820, whose fix
    makes a host consumer of a pinned buffer produced by a D2H copy wait on the host)."""
    _prediction_writer(host_waits=False)


def prediction_ring_read_after_event_synchronize():
    """Fixed: ``event.synchronize()`` before the host reads the slot."""
    _prediction_writer(host_waits=True)


# ------------------------------------------------------------------ D2H into pinned vs pageable host memory
def _loss_logging(pinned):
    """Per-sample losses are written into a persistent GPU buffer every step; a logger copies them on its d2h stream
    with ``non_blocking=True`` into a host buffer allocated once, and sums them on the host. ``pinned``: the host
    buffer is pinned (the copy is asynchronous); else it is pageable, and CUDA returns from the copy only once it
    is complete."""
    (d2h,) = streams("d2h")
    b, d = 256, 64
    x = torch.full((b, d), 0.5, device="cuda")
    w = torch.full((d,), 0.25, device="cuda")
    losses = torch.empty(b, device="cuda")  # rewritten every step
    host = torch.empty(b, pin_memory=pinned)
    cur = torch.cuda.current_stream()
    logged = []
    for step in range(3):
        losses.copy_(torch.mv(x, w) * (step + 1))  # the step's per-sample losses
        d2h.wait_stream(cur)
        with torch.cuda.stream(d2h):
            host.copy_(losses, non_blocking=True)
        logged.append(host.sum().item())
    torch.cuda.synchronize()


def loss_log_d2h_into_pinned_buffer():
    """With a pinned host buffer the logger's copy is asynchronous: the host sums the buffer before the copy is
    known complete (read after write: pytorch/pytorch#86264, "The code starts executing the operations on CPU before
    the memcopies are finalized"; PTB-MR/mrpro#984, chunks of zeros in images moved to the CPU with
    ``non_blocking=True``), and the next step overwrites the losses the copy may still be reading (write after
    read), the default stream never having waited for the d2h stream."""
    _loss_logging(pinned=True)


def loss_log_d2h_into_pageable_buffer():
    """A correct program a detector that trusts ``non_blocking=True`` would flag: into pageable memory the copy is
    synchronous ("For transfers from device memory to pageable host memory, the function will return only once the
    copy has completed", as quoted in pytorch/pytorch#39694), so the host's sum and the next step's overwrite both
    come after it."""
    _loss_logging(pinned=False)


# ------------------------------------------------------------------ prefetch into a fixed input buffer
def _static_input_training(free_after_backward):
    """Training from one fixed GPU input buffer (as for a CUDA graph's static input): the copy stream prefetches the
    next batch into it once an event says the input is free. The event is recorded after the forward pass (the bug:
    the first layer's matmul saved the input, and its backward reads it again to compute the weight's gradient) or
    after ``backward()`` (the fix)."""
    (copy,) = streams("copy")
    steps, b, d = 3, 64, 256
    batches = [torch.full((b, d), 0.01 * (i + 1)).pin_memory() for i in range(steps)]
    static_x = torch.empty(b, d, device="cuda")
    w = torch.full((d, 8), 0.01, device="cuda", requires_grad=True)
    cur = torch.cuda.current_stream()
    copy.wait_stream(cur)
    with torch.cuda.stream(copy):
        static_x.copy_(batches[0], non_blocking=True)
    input_free = torch.cuda.Event()
    for step in range(steps):
        cur.wait_stream(copy)  # the step's batch is in the buffer
        loss = torch.mm(static_x, w).square().sum()  # mm saves static_x for w's gradient
        if not free_after_backward:
            input_free.record()  # "the forward pass has consumed its input"
        loss.backward()  # MmBackward0: static_x.t() @ grad
        if free_after_backward:
            input_free.record()
        if step + 1 < steps:
            copy.wait_event(input_free)
            with torch.cuda.stream(copy):
                static_x.copy_(batches[step + 1], non_blocking=True)  # prefetch the next batch
        with torch.no_grad():
            w -= 0.1 * w.grad
        w.grad = None
    torch.cuda.synchronize()


def static_input_refilled_before_backward():
    """The prefetch waits for an event recorded after the forward pass, so it may overwrite the input while the
    backward pass's matmul still reads it (write after read): the weight's gradient mixes two batches."""
    _static_input_training(free_after_backward=False)


def static_input_refilled_after_backward():
    """Fixed: the event is recorded after ``backward()``, the input's last reader."""
    _static_input_training(free_after_backward=True)


# ------------------------------------------------------------------ Tensor.pin_memory() of a reused host buffer
def _decoded_uploads(pinned_buffer):
    """A CPU decoder writes each image into one reusable host buffer; the loader stages it with ``pin_memory()`` and
    copies it to the GPU with ``non_blocking=True``. ``pin_memory()`` copies a pageable buffer into new pinned memory,
    but returns a buffer that is already pinned (allocated with ``pin_memory=True`` to save the copy) as it is."""
    steps, c = 3, 3
    decoded = [torch.full((c, H, W), float(i)) for i in range(steps)]  # the decoder's output (pageable)
    buf = torch.empty(c, H, W, pin_memory=pinned_buffer)
    images = []
    for step in range(steps):
        buf.copy_(decoded[step])  # the decoder fills its buffer
        staged = buf.pin_memory()
        images.append(staged.cuda(non_blocking=True).mean(dim=0))
    torch.cuda.synchronize()


def pinned_decode_buffer_staged_as_itself():
    """The reusable buffer is pinned, so ``pin_memory()`` returns it itself (it checks ``is_pinned()`` first since the
    fix of pytorch/pytorch#21076, "tensor.pin_memory always copies even when it is already pinned"): the decoder's
    next write into the buffer may land while the previous image's copy still reads it (write after read)."""
    _decoded_uploads(pinned_buffer=True)


def pageable_decode_buffer_staged_as_copy():
    """A correct program: the reusable buffer is pageable, each ``pin_memory()`` is a new pinned copy that only the
    copy reads, and refilling the original buffer at once is safe."""
    _decoded_uploads(pinned_buffer=False)


SCENARIOS = [
    dataloader_batch_denormalized_during_h2d, dataloader_batch_denormalized_on_clone,
    staging_ring_synchronized_after_refill, staging_ring_synchronized_before_refill,
    torchcodec_convert_without_decoder_wait, torchcodec_convert_waits_for_decoder,
    torchcodec_frame_released_without_record_stream, torchcodec_frame_recorded_on_convert_stream,
    prediction_ring_read_after_stream_wait, prediction_ring_read_after_event_synchronize,
    loss_log_d2h_into_pinned_buffer, loss_log_d2h_into_pageable_buffer,
    static_input_refilled_before_backward, static_input_refilled_after_backward,
    pinned_decode_buffer_staged_as_itself, pageable_decode_buffer_staged_as_copy,
]

# (kind, previous role, previous op, current role, current op) per scenario, in the order streamsan reports them.
EXPECTED = {
    # the in-place mul_ of each batch (count 3); the add_ after it is the host's own write
    "dataloader_batch_denormalized_during_h2d": [
        ("host-device", "default", "aten::_to_copy", "host", "aten::mul_.Tensor"),
    ],
    "dataloader_batch_denormalized_on_clone": [],
    # steps 2, 3 and 4 each refill a slot the copy two steps before read (count 3)
    "staging_ring_synchronized_after_refill": [
        ("host-device", "copy", "aten::_to_copy", "host", "aten::copy_"),
    ],
    "staging_ring_synchronized_before_refill": [],
    # one finding for the three frames
    "torchcodec_convert_without_decoder_wait": [
        ("device-device", "decode", "aten::copy_", "default", "aten::sub.Tensor"),
    ],
    "torchcodec_convert_waits_for_decoder": [],
    # frames 0-2, each at the decoder's next allocation (count 3; a reuse of the block is folded in)
    "torchcodec_frame_released_without_record_stream": [
        ("missing-record-stream", "convert", "aten::sub.Tensor", "decode", "allocation"),
    ],
    "torchcodec_frame_recorded_on_convert_stream": [],
    # steps 1-3 read the previous step's slot (count 3); the last read follows a synchronize()
    "prediction_ring_read_after_stream_wait": [
        ("host-device", "d2h", "aten::copy_", "host", "Tensor.tolist"),
    ],
    "prediction_ring_read_after_event_synchronize": [],
    # both have step 0's copy as their previous access: the host's sum at step 0 (count 3) comes before the default
    # stream's overwrite at step 1 (count 2)
    "loss_log_d2h_into_pinned_buffer": [
        ("host-device", "d2h", "aten::copy_", "host", "aten::sum"),
        ("device-device", "d2h", "aten::copy_", "default", "aten::copy_"),
    ],
    "loss_log_d2h_into_pageable_buffer": [],
    # the backward's mm (grad of w, reading static_x) vs the next prefetch, at steps 0 and 1 (count 2)
    "static_input_refilled_before_backward": [
        ("device-device", "default", "aten::mm", "copy", "aten::copy_"),
    ],
    "static_input_refilled_after_backward": [],
    # steps 1 and 2 (count 2)
    "pinned_decode_buffer_staged_as_itself": [
        ("host-device", "default", "aten::_to_copy", "host", "aten::copy_"),
    ],
    "pageable_decode_buffer_staged_as_copy": [],
}


test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED)
