"""Stream bugs of training and data-loading code from real projects, reduced to small programs, each with its fix.

Every buggy scenario reproduces the pattern of a stream bug reported or fixed in a training or data-loading code
base (apex, timm, torchrec, FSDP, DeepSpeed, torchtitan, Megatron-LM); its fixed counterpart applies the fix the
project applied (or the canonical one). Collectives are emulated with local ops so that one GPU suffices: an
all-gather is a ``cat`` into the flat buffer, an all-reduce is the pre-divide of the bucket.

EXPECTED maps each scenario to the (kind, previous stream role, previous op, current stream role, current op)
tuples that streamsan's semantics (docs/semantics.md) imply for it. Side streams are named after their role in the
modelled project ("copy", "unshard", "reduce", "d2h", ...).
"""

import math

import torch
from torch.utils._mode_utils import no_dispatch
from tests.gpu.support.scenario_kit import scenario_tests, streams


N = 1 << 16


# ------------------------------------------------------------------------------ apex / timm data prefetcher
class _Prefetcher:
    """The data prefetcher of apex's ImageNet example (examples/imagenet/main_amp.py, ``data_prefetcher``), reduced:
    the next batch is copied to the GPU and normalized on a side stream while the current one trains.

    ``wait``: the consumer waits for the copy stream before taking a batch; ``record``: the batch is recorded on
    the consumer's stream; ``producer_waits``: the copy stream waits for the consumer before each batch (timm)."""

    def __init__(self, batches, wait=True, record=True, producer_waits=False):
        (self.stream,) = streams("copy")
        self.loader = iter(batches)
        self.wait, self.record, self.producer_waits = wait, record, producer_waits
        self.batch = None
        self._preload()

    def _preload(self):
        host = next(self.loader, None)
        if host is None:
            self.batch = None
            return
        if self.producer_waits:
            self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            x = host.to("cuda", non_blocking=True)
            self.batch = x.sub_(0.5).div_(0.25)  # normalization, on the copy stream too

    def next(self):
        if self.wait:
            torch.cuda.current_stream().wait_stream(self.stream)
        batch = self.batch
        if batch is not None and self.record:
            batch.record_stream(torch.cuda.current_stream())
        self._preload()
        return batch


def _pinned_batches(n=4):
    """What ``DataLoader(pin_memory=True)`` yields: pinned host batches."""
    return [torch.full((N,), float(i)).pin_memory() for i in range(n)]


def _train_on(prefetcher):
    w = torch.full((N,), 2.0, device="cuda")
    batch = prefetcher.next()
    while batch is not None:
        out = batch * w  # the forward pass, on the default stream
        batch = prefetcher.next()  # drops the previous batch (after the copy stream allocated the next one)
    torch.cuda.synchronize()
    del out


def prefetcher_missing_wait_stream():
    """Models ROCm/pytorch#3194 (a default-stream consumer of a transfer-stream copy reading pre-copy state) against
    NVIDIA/apex examples/imagenet/main_amp.py ``data_prefetcher.next()``: without ``wait_stream`` the default stream
    reads the batch while the copy stream may still be copying and normalizing it."""
    _train_on(_Prefetcher(_pinned_batches(), wait=False))


def prefetcher_missing_record_stream():
    """Models huggingface/pytorch-image-models ``PrefetchLoader`` before #2784, and NVIDIA/apex ``data_prefetcher``
    without its ``record_stream``: a batch allocated on the copy stream is dropped after the default stream used it;
    the copy stream's next allocation can take its block while the default stream may still read it."""
    _train_on(_Prefetcher(_pinned_batches(), record=False))


def apex_data_prefetcher():
    """Fixed (NVIDIA/apex examples/imagenet/main_amp.py ``data_prefetcher``): the consumer waits for the copy stream
    and records the batch on its own stream."""
    _train_on(_Prefetcher(_pinned_batches()))


def prefetcher_copy_stream_waits_for_consumer():
    """Fixed as huggingface/pytorch-image-models#2784 did: no ``record_stream``, but the prefetch stream waits for the
    consumer stream before each batch, so storage the consumer released is not reused while its reads are queued."""
    _train_on(_Prefetcher(_pinned_batches(), record=False, producer_waits=True))


# ------------------------------------------------------------------------------ torchrec sparse-dist pipeline
def _sparse_dist_pipeline(fence):
    """``PrefetchTrainPipelineSparseDist``, reduced: each batch's input dist (an all-to-all) writes ``dist_input`` on
    the data-dist stream; the embedding cache prefetch reads it on the prefetch stream; then it is dropped."""
    dist, prefetch = streams("dist", "prefetch")
    cache = torch.zeros(N, device="cuda")  # the embedding table's UVM cache
    prefetch.wait_stream(torch.cuda.current_stream())
    for step in range(3):
        if fence:
            dist.wait_stream(prefetch)  # the fix: the next input dist waits for the last prefetch
        with torch.cuda.stream(dist):
            dist_input = torch.empty(N, device="cuda")
            dist_input.fill_(float(step))  # the input dist's output
        prefetch.wait_stream(dist)
        with torch.cuda.stream(prefetch):
            cache.add_(dist_input)  # the cache prefetch reads it
        del dist_input
    torch.cuda.current_stream().wait_stream(prefetch)
    out = cache * 2.0  # the forward reads the cache
    torch.cuda.synchronize()
    del out


def sparse_dist_prefetch_unfenced():
    """Models meta-pytorch/torchrec#4191 (UVM cache cross-stream race in PrefetchTrainPipelineSparseDist): the
    data-dist stream allocates the next batch's input-dist output while the prefetch stream may still read the
    previous one, freed without a fence or ``record_stream``."""
    _sparse_dist_pipeline(fence=False)


def sparse_dist_prefetch_fenced():
    """Fixed as meta-pytorch/torchrec#4191 did: ``data_dist_stream.wait_stream(prefetch_stream)`` before the next
    input dist."""
    _sparse_dist_pipeline(fence=True)


# ------------------------------------------------------------------------------ FSDP reshard
def _fsdp_forward(fix):
    """FSDP1's forward over two layers, as torch/distributed/fsdp/_flat_param.py does it: each layer's unsharded flat
    parameter gets its storage by a storage resize on the unshard stream (``_alloc_storage``), is filled by the
    all-gather there, is used by the layer on the default stream and loses its storage again by a resize to 0
    (``_free_storage``) at reshard."""
    (unshard,) = streams("unshard")
    compute = torch.cuda.current_stream()
    shards = [torch.full((N // 2,), float(rank), device="cuda") for rank in range(2)]
    flats = [torch.empty(N, device="cuda") for _ in range(2)]
    for flat in flats:
        flat.untyped_storage().resize_(0)  # FSDP keeps unsharded flat parameters without storage
    unshard.wait_stream(compute)
    outs = []
    pending = None
    for flat in flats:
        if pending is not None:  # the event fix: wait for the previous layer's compute, then free its buffer
            unshard.wait_event(pending[1])
            pending[0].untyped_storage().resize_(0)
        with torch.cuda.stream(unshard):
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            torch.cat(shards, out=flat)  # the all-gather into the flat parameter
        compute.wait_stream(unshard)
        outs.append(flat * 2.0)  # the layer's forward
        if fix == "event":
            done = torch.cuda.Event()
            done.record()
            pending = (flat, done)
            continue
        if fix == "record_stream":
            with no_dispatch():  # FSDP's _no_dispatch_record_stream
                flat.record_stream(compute)
        flat.untyped_storage().resize_(0)  # reshard
    torch.cuda.synchronize()


def fsdp_reshard_without_record_stream():
    """Models pytorch/pytorch torch/distributed/fsdp/_flat_param.py ``FlatParamHandle._free_unsharded_flat_param``
    without its ``_no_dispatch_record_stream``: the unsharded flat parameter (allocated on the unshard stream) is
    freed after the default stream used it; the next layer's unshard can take the block while the layer still
    reads it."""
    _fsdp_forward(fix=None)


def fsdp_reshard_with_record_stream():
    """Fixed as FSDP1 does: ``record_stream(current stream)`` (under ``no_dispatch``) before ``_free_storage``."""
    _fsdp_forward(fix="record_stream")


def fsdp_reshard_with_free_event():
    """Fixed as pytorch/pytorch#108234 (FSDP rate limiter and memory reuse) does: the unshard stream waits for an
    event recorded after the layer's compute, and the previous buffer is freed only after that wait."""
    _fsdp_forward(fix="event")


# ------------------------------------------------------------------------------ DeepSpeed ZeRO gradient reduction
def _ipg_bucket(wait_all):
    """ZeRO 1/2 with ``overlap_comm``: gradient hooks copy gradients into the contiguous IPG bucket, here from two
    autograd streams; ``average_tensor`` then reduces the bucket on the reduction stream."""
    side, reduce = streams("side", "reduce")
    compute = torch.cuda.current_stream()
    w1 = torch.full((N // 2,), 1.0, device="cuda")
    w2 = torch.full((N // 2,), 2.0, device="cuda")
    bucket = torch.empty(N, device="cuda")
    side.wait_stream(compute)
    g1 = w1 * 3.0  # a gradient hook on the default stream ...
    bucket[: N // 2].copy_(g1)
    with torch.cuda.stream(side):  # ... and one on another autograd stream
        g2 = w2 * 3.0
        bucket[N // 2:].copy_(g2)
    reduce.wait_stream(compute)  # average_tensor: the reduction stream waits for the current stream
    if wait_all:
        reduce.wait_stream(side)  # the fix: it waits for every stream that copied into the bucket
    with torch.cuda.stream(reduce):
        bucket.div_(2)  # the pre-divide of the all-reduce
    compute.wait_stream(reduce)
    torch.cuda.synchronize()


def zero_bucket_waits_for_one_producer():
    """Models deepspeedai/DeepSpeed#8061: ``average_tensor`` makes the reduction stream wait only for the current
    stream, while another stream copied gradients into the same IPG bucket; the reduction may read (and divide)
    the bucket before that copy is done."""
    _ipg_bucket(wait_all=False)


def zero_bucket_waits_for_all_producers():
    """Fixed as deepspeedai/DeepSpeed#8080 did: the bucket remembers the streams that copied into it and the
    reduction stream waits for each."""
    _ipg_bucket(wait_all=True)


def _reduce_and_release(record):
    """ZeRO's overlapped reduction of a bucket of gradients on the reduction stream, after which the gradients are
    released (``param.grad = None``) while the backward goes on allocating on the default stream."""
    (reduce,) = streams("reduce")
    w = torch.full((N,), 1.0, device="cuda")
    g1, g2 = w * 0.5, w * 0.25  # gradients of two parameters, from the backward on the default stream
    reduce.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(reduce):
        flat = torch.cat([g1, g2])  # flatten the bucket on the reduction stream
        flat.div_(2)  # and average it (the all-reduce)
    if record:
        g1.record_stream(reduce)
        g2.record_stream(reduce)
    del g1, g2  # released
    more = w * 0.125  # the next gradient, allocated on the default stream
    torch.cuda.current_stream().wait_stream(reduce)
    step = flat[:N] * more  # the optimizer step reads the averaged bucket
    torch.cuda.synchronize()
    del step


def zero_grads_released_during_reduction():
    """Models deepspeedai/DeepSpeed#7965 (fix overlap-comm buffer lifetimes, NaN loss under ZeRO-2): buffers used on
    the reduction stream were not recorded on it, so the caching allocator could recycle them for the default
    stream's next allocation before the queued reduction had read them."""
    _reduce_and_release(record=False)


def zero_grads_recorded_on_reduction_stream():
    """Fixed as deepspeedai/DeepSpeed#7965 did: ``record_stream(reduction_stream)`` on the buffers it uses."""
    _reduce_and_release(record=True)


# ------------------------------------------------------------------------------ activation offloading
def _offload_two_steps(wait_on_compute):
    """Activation offloading into a reused pinned pool, over two steps: the forward copies an activation into a pool
    slot on the D2H stream, the backward reloads it on the H2D stream."""
    d2h, h2d = streams("d2h", "h2d")
    slot = torch.empty(N, pin_memory=True)  # a slot of the pinned pool, reused every step
    w = torch.full((N,), 2.0, device="cuda")
    kept = []
    for step in range(2):
        act = w * float(step + 1)  # forward: the activation to offload
        compute = torch.cuda.current_stream()
        with torch.cuda.stream(d2h):
            if wait_on_compute:
                d2h.wait_stream(compute)  # the fix: the compute stream, captured before entering the context
            else:
                d2h.wait_stream(torch.cuda.current_stream())  # inside the context: d2h itself, a no-op
            slot.copy_(act, non_blocking=True)
        h2d.wait_stream(d2h)  # backward: reload the activation
        with torch.cuda.stream(h2d):
            back = slot.to("cuda", non_blocking=True)
        compute.wait_stream(h2d)
        kept.append((back, back * 2.0))
    torch.cuda.synchronize()


def offload_waits_on_its_own_stream():
    """Models the bug found in pytorch/torchtitan#2581 (async activation offloading with a pinned pool): inside
    ``with torch.cuda.stream(d2h)``, ``torch.cuda.current_stream()`` is d2h, so the wait was a no-op; the D2H copy
    reads the activation before the compute stream wrote it and overwrites the pool slot the previous step's H2D
    copy may still read."""
    _offload_two_steps(wait_on_compute=False)


def offload_waits_on_compute_stream():
    """Fixed as pytorch/torchtitan#2581 did: the compute stream is captured before the context switch."""
    _offload_two_steps(wait_on_compute=True)


def _stash_activation(record):
    """torchrec's memory stashing, reduced: an activation is copied to pinned host memory on a side stream and its GPU
    storage is released at once with ``untyped_storage().resize_(0)``; new work on the default stream allocates."""
    (d2h,) = streams("d2h")
    w = torch.full((N,), 1.0, device="cuda")
    host = torch.empty(N, pin_memory=True)
    act = w * 3.0
    d2h.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(d2h):
        host.copy_(act, non_blocking=True)
    if record:
        act.record_stream(d2h)
    act.untyped_storage().resize_(0)  # stash: give the GPU memory back now
    more = w * 5.0  # the default stream allocates again
    torch.cuda.synchronize()
    host.sum()  # validate the stashed copy
    del more


def stash_freed_without_record_stream():
    """Models meta-pytorch/torchrec#4231 (the NaN of memory_stashing.py reproduced: ``record_stream`` missing before
    the storage resize): the default stream's next allocation can reuse the activation's block while the D2H copy
    on the side stream still reads it."""
    _stash_activation(record=False)


def stash_freed_with_record_stream():
    """Fixed as torchrec did: ``tensor.record_stream(d2h_stream)`` before ``untyped_storage().resize_(0)``."""
    _stash_activation(record=True)


# ------------------------------------------------------------------------------ host reads of async D2H copies
def _overflow_check(non_blocking):
    """The loss scaler's overflow check: the sum of the gradients is copied into a pinned scalar and read on the
    host."""
    grads = torch.full((N,), 0.5, device="cuda")
    buf = torch.empty((), pin_memory=True)
    buf.copy_(grads.sum(), non_blocking=non_blocking)
    overflow = not math.isfinite(float(buf))
    torch.cuda.synchronize()
    return overflow


def overflow_check_reads_pending_copy():
    """Models deepspeedai/DeepSpeed#501 (``_async_has_inf_or_nan``:
    ``float(async_buff.copy_(x.float().sum(), non_blocking=True))``, the race caught in review): ``float()`` reads
    the pinned buffer before the D2H copy is known complete."""
    return _overflow_check(non_blocking=True)


def overflow_check_blocking_copy():
    """Fixed: a blocking copy (the host waits for it) before the host reads the value."""
    return _overflow_check(non_blocking=False)


def _stage_checkpoint(sync):
    """Asynchronous checkpointing: the parameters are staged into pinned host buffers with non-blocking D2H copies,
    then the writer serializes the host buffers."""
    params = [torch.full((N // 4,), float(i), device="cuda") for i in range(3)]
    staged = [torch.empty_like(p, device="cpu", pin_memory=True) for p in params]
    for p, h in zip(params, staged):
        h.copy_(p, non_blocking=True)
    if sync:
        torch.cuda.synchronize()  # the fix
    blob = b"".join(h.numpy().tobytes() for h in staged)  # the writer reads the staged tensors
    torch.cuda.synchronize()
    return blob


def checkpoint_staged_without_sync():
    """Models NVIDIA/Megatron-LM#833 (dist_checkpointing/strategies/filesystem_async.py: non_blocking D2H without
    any synchronization before the write; also the review of PrimeIntellect-ai/prime-rl#3109): the writer reads the
    pinned staging buffers before the D2H copies are known complete."""
    return _stage_checkpoint(sync=False)


def checkpoint_staged_with_sync():
    """Fixed as Megatron-LM did (commit 66da23bff): ``torch.cuda.synchronize()`` after the non-blocking transfers."""
    return _stage_checkpoint(sync=True)


SCENARIOS = [
    prefetcher_missing_wait_stream, prefetcher_missing_record_stream, apex_data_prefetcher,
    prefetcher_copy_stream_waits_for_consumer, sparse_dist_prefetch_unfenced, sparse_dist_prefetch_fenced,
    fsdp_reshard_without_record_stream, fsdp_reshard_with_record_stream, fsdp_reshard_with_free_event,
    zero_bucket_waits_for_one_producer, zero_bucket_waits_for_all_producers, zero_grads_released_during_reduction,
    zero_grads_recorded_on_reduction_stream, offload_waits_on_its_own_stream, offload_waits_on_compute_stream,
    stash_freed_without_record_stream, stash_freed_with_record_stream, overflow_check_reads_pending_copy,
    overflow_check_blocking_copy, checkpoint_staged_without_sync, checkpoint_staged_with_sync,
]

# (kind, previous role, previous op, current role, current op) per scenario, in the order streamsan reports them.
EXPECTED = {
    "prefetcher_missing_wait_stream": [
        ("device-device", "copy", "aten::div_.Tensor", "default", "aten::mul.Tensor")],
    # batch 0's block: the copy stream allocates batch 3 after batch 0 was dropped (the reuse, if any, is folded in)
    "prefetcher_missing_record_stream": [
        ("missing-record-stream", "default", "aten::mul.Tensor", "copy", "allocation")],
    "apex_data_prefetcher": [],
    "prefetcher_copy_stream_waits_for_consumer": [],
    "sparse_dist_prefetch_unfenced": [
        ("missing-record-stream", "prefetch", "aten::add_.Tensor", "dist", "allocation")],
    "sparse_dist_prefetch_fenced": [],
    # The allocation is the storage resize of the second layer's unshard. What the semantics imply for the true
    # events; the tracer sees a storage-resize allocation outside any aten op (its ALLOC has no size) and FSDP's
    # record_stream not at all (no_dispatch), so expect these two to disagree until it does.
    "fsdp_reshard_without_record_stream": [
        ("missing-record-stream", "default", "aten::mul.Tensor", "unshard", "allocation")],
    "fsdp_reshard_with_record_stream": [],
    "fsdp_reshard_with_free_event": [],
    "zero_bucket_waits_for_one_producer": [
        ("device-device", "side", "aten::copy_", "reduce", "aten::div_.Tensor")],
    "zero_bucket_waits_for_all_producers": [],
    # both gradients' blocks are pending with the same cat: one finding (count 2)
    "zero_grads_released_during_reduction": [
        ("missing-record-stream", "reduce", "aten::cat", "default", "allocation")],
    "zero_grads_recorded_on_reduction_stream": [],
    # step 0: the copy reads the activation the default stream wrote; step 1: it overwrites the slot h2d read
    "offload_waits_on_its_own_stream": [
        ("device-device", "default", "aten::mul.Tensor", "d2h", "aten::copy_"),
        ("device-device", "h2d", "aten::_to_copy", "d2h", "aten::copy_")],
    "offload_waits_on_compute_stream": [],
    "stash_freed_without_record_stream": [
        ("missing-record-stream", "d2h", "aten::copy_", "default", "allocation")],
    "stash_freed_with_record_stream": [],
    "overflow_check_reads_pending_copy": [
        ("host-device", "default", "aten::copy_", "host", "aten::_local_scalar_dense")],
    "overflow_check_blocking_copy": [],
    # the read itself, seen when it happens (the view is of memory an asynchronous copy writes)
    "checkpoint_staged_without_sync": [
        ("host-device", "default", "aten::copy_", "host", "numpy.ndarray.tobytes")],
    "checkpoint_staged_with_sync": [],
}


test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED)
