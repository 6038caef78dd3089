"""Stream bugs of copies to and from the host around training and serving (activations saved for backward,
gradients for a CPU optimizer, predictions written to disk, KV blocks loaded), each as a small buggy program and
its fix, modelled on real PyTorch-ecosystem code.

The patterns here are ones test_training.py and test_inference.py do not have: activation offloading
through ``torch.autograd.graph.saved_tensors_hooks`` whose races involve the backward pass (trl / axolotl, Megatron-LM,
torchtune), CPU optimizers fed by gradient hooks (torchao, FSDP2's optimizer-in-backward), a prediction writer that
``torch.save``s pending device-to-host copies (Lightning) and a KV load racing the zeroing of fresh blocks (vLLM).
Every program is plain PyTorch with tensors of at most 1 << 16 elements; the library code is reduced to the lines
that order (or fail to order) the streams, written for this file.

EXPECTED maps each scenario to the (kind, previous stream role, previous op, current stream role, current op)
tuples that docs/semantics.md implies, in the order streamsan reports them; fixed programs expect ``[]``.
Stream roles: "default" (the current stream), "host", and the side streams each program names ("transfer",
"compute", "d2h", "copy", "offload", "reduce", "load"). Backward ops run in the autograd engine's threads, on the
stream their forward op ran on.
"""

import io

import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from tests.gpu.support.scenario_kit import scenario_tests, streams


N = 1 << 16




# ------------------------------------------------------------------ trl OffloadActivations (saved-tensor hooks)
class _OffloadActivations(saved_tensors_hooks):
    """trl's ``OffloadActivations`` with streams (trl/models/activation_offloading.py, from torchtune), reduced.

    pack: an activation of at least ``min_bytes`` is copied to pinned host memory on the transfer stream ``s1``
    after ``s1`` waited for the compute stream ``s0``, and stays in ``fwd_stash`` (with an event recorded after its
    copy) so that its GPU memory lives until the copy is done; a storage seen before is kept as it is. unpack: an
    activation still in ``fwd_stash`` is handed back without a copy (here every offloaded activation is: fewer of
    them than ``max_fwd_stash_size``, as for the last layers of a model). ``release()`` is trl's end-of-backward
    callback: ``s0`` waits for each stashed event, then the stash drops the tensor.

    ``clone_on_transfer``: an activation at a storage offset is cloned inside the transfer-stream context, after the
    wait (before huggingface/trl#7195), instead of on the compute stream before it. ``cached_s0``: ``s0`` is the
    stream current when the hooks were made (before trl#7195), instead of the one current at each use."""

    def __init__(self, clone_on_transfer=False, cached_s0=False, min_bytes=1024):
        self._init_stream = torch.cuda.current_stream()
        (self.s1,) = streams("transfer")
        self.clone_on_transfer = clone_on_transfer
        self.cached_s0 = cached_s0
        self.min_bytes = min_bytes
        self.next_id = 0
        self.tracker = {}  # id -> (tensor, offloaded)
        self.fwd_stash = {}  # id -> (GPU activation, event recorded after its copy)
        self.seen = set()  # storages already offloaded this step
        super().__init__(self._pack, self._unpack)

    @property
    def s0(self):
        return self._init_stream if self.cached_s0 else torch.cuda.current_stream()

    def _pack(self, activation):
        self.next_id += 1
        tid = self.next_id
        key = (activation.untyped_storage().data_ptr() + activation.storage_offset(), activation.dtype)
        if not activation.is_cuda or activation.nbytes < self.min_bytes or key in self.seen:
            self.tracker[tid] = (activation, False)
            return tid
        self.seen.add(key)
        offset = activation.storage_offset() != 0
        if offset and not self.clone_on_transfer:
            activation = activation.clone()  # trl#7195: on the compute stream, covered by the wait below
        self.s1.wait_stream(self.s0)
        with torch.cuda.stream(self.s1):
            if offset and self.clone_on_transfer:
                activation = activation.clone()  # before trl#7195: transfer-stream memory, after the wait
            cpu = torch.empty_like(activation, device="cpu", pin_memory=True)
            cpu.copy_(activation, non_blocking=True)
        self.tracker[tid] = (cpu, True)
        self.fwd_stash[tid] = (activation, self.s1.record_event())
        return tid

    def _unpack(self, tid):
        value, offloaded = self.tracker.pop(tid)
        if offloaded:
            value = self.fwd_stash[tid][0]  # still on the GPU: no copy back
        return value

    def release(self):
        for tid, (_, event) in list(self.fwd_stash.items()):
            self.s0.wait_event(event)
            del self.fwd_stash[tid]
        self.seen.clear()


def _cross_entropy_steps(clone_on_transfer):
    B, V = 4096, 16
    offloader = _OffloadActivations(clone_on_transfer=clone_on_transfer)
    for step in range(2):
        logits = torch.full((B, V), 0.1 * (step + 1), device="cuda", requires_grad=True)  # the model's output
        labels = torch.arange(B + 1, device="cuda") % V
        with offloader:
            loss = F.cross_entropy(logits, labels[1:])  # shift_labels: a view at storage offset 1
        loss.backward()
        offloader.release()
    torch.cuda.synchronize()


def trl_offload_clones_on_transfer_stream():
    """Models axolotl-ai-cloud/axolotl#3833 (worked around there; fixed upstream in huggingface/trl#7195, second
    race): ``pack_tensor`` cloned cross-entropy's offset ``shift_labels`` inside the transfer-stream context, so the
    stashed clone is written on the transfer stream and read by ``nll_loss_backward`` on the compute stream with no
    edge between them."""
    _cross_entropy_steps(clone_on_transfer=True)


def trl_offload_clones_on_compute_stream():
    """The fix of huggingface/trl#7195 (and axolotl#3833's pre-clone): the clone runs on the compute stream before
    ``s1.wait_stream(s0)``, so the copy is ordered after it and the backward reads it on the stream that wrote it."""
    _cross_entropy_steps(clone_on_transfer=False)


def _exp_steps_on_compute_stream(cached_s0):
    (compute,) = streams("compute")
    offloader = _OffloadActivations(cached_s0=cached_s0)  # made at trainer setup, on the default stream
    x = torch.full((N,), 0.5, device="cuda", requires_grad=True)
    compute.wait_stream(torch.cuda.current_stream())

    def forward():
        with offloader:
            y = x.exp()  # ExpBackward0 saves its result: offloaded
        return y.sum()

    with torch.cuda.stream(compute):  # a custom op / recompute running the layer on a stream of its own
        for _ in range(2):
            loss = forward()
            loss.backward()
            offloader.release()
    torch.cuda.current_stream().wait_stream(compute)
    torch.cuda.synchronize()


def trl_offload_waits_on_cached_stream():
    """Models huggingface/trl#7195 (first race; axolotl-ai-cloud/axolotl#3878 did the same for its own offloader):
    ``self.s0`` was the default stream cached at construction; with the forward on another stream the transfer
    stream's copy reads the activation before the compute stream wrote it, and the stash is released after the
    default stream, not the compute stream, waited for the copy, so the compute stream's next allocation can take
    the block the copy still reads."""
    _exp_steps_on_compute_stream(cached_s0=True)


def trl_offload_waits_on_current_stream():
    """The fix of huggingface/trl#7195: ``s0`` is a property, the stream current at each pack and release."""
    _exp_steps_on_compute_stream(cached_s0=False)


# ------------------------------------------------------------------ Megatron-LM fine-grained activation offloading
class _ChunkOffload(saved_tensors_hooks):
    """Megatron-LM's fine-grained activation offloading (``ChunkOffloadHandler``), reduced to one group:
    ``tensor_push`` copies the activation into pinned memory on the D2H stream and records ``_offload_event`` there;
    ``tensor_pop`` reloads it inline with ``reload()``, on the caller's current stream."""

    def __init__(self, wait_offload_event):
        (self.d2h,) = streams("d2h")
        self.offload_event = torch.cuda.Event()
        self.wait_offload_event = wait_offload_event
        super().__init__(self._push, self._pop)

    def _push(self, t):
        self.d2h.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.d2h):
            buf = torch.empty_like(t, device="cpu", pin_memory=True)
            buf.copy_(t, non_blocking=True)
        t.record_stream(self.d2h)  # the GPU activation may go once the copy is done
        self.offload_event.record(self.d2h)
        return buf

    def _pop(self, buf):
        if self.wait_offload_event:
            torch.cuda.current_stream().wait_event(self.offload_event)  # what bulk_reload_group does
        return buf.to("cuda", non_blocking=True)  # reload() on the current stream


def _megatron_reload(wait_offload_event):
    offload = _ChunkOffload(wait_offload_event)
    x = torch.full((N,), 0.5, device="cuda", requires_grad=True)

    def forward():
        with offload:
            y = x.exp()
        return y.sum()

    loss = forward()
    loss.backward()  # the warmup iteration: nothing prefetched the group, tensor_pop reloads it inline
    torch.cuda.synchronize()


def megatron_inline_reload_without_offload_event():
    """Models NVIDIA/Megatron-LM#7398: the inline reload in ``tensor_pop`` enqueues its H2D copy on the current
    stream with no edge on the group's ``_offload_event``, so it reads the pinned staging buffer while the D2H copy
    that fills it (on the D2H stream) may still run."""
    _megatron_reload(wait_offload_event=False)


def megatron_inline_reload_waits_offload_event():
    """The fix NVIDIA/Megatron-LM#7398 asks for (the edge ``bulk_reload_group`` already has): the current stream
    waits for ``_offload_event`` before the inline reload."""
    _megatron_reload(wait_offload_event=True)


# ------------------------------------------------------------------ torchtune / save_on_cpu with a copy stream
class _OffloadWithCopyStream(saved_tensors_hooks):
    """Activation offloading with a copy stream, as in pytorch/pytorch#106360's faster ``save_on_cpu`` and the first
    stream version of torchtune's ``OffloadActivations``: the activation goes to pinned memory on the copy stream in
    pack, and comes back on the copy stream in unpack, where its GPU tensor is allocated from the copy stream's
    pool; the compute stream waits for the copy. ``record``: the unpacked tensor is recorded on the compute stream
    (torchtune's fix)."""

    def __init__(self, record):
        (self.copy,) = streams("copy")
        self.record = record
        super().__init__(self._pack, self._unpack)

    def _pack(self, t):
        self.copy.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy):
            cpu = t.to("cpu", non_blocking=True)
        t.record_stream(self.copy)
        return cpu

    def _unpack(self, cpu):
        with torch.cuda.stream(self.copy):
            gpu = cpu.to("cuda", non_blocking=True)
        compute = torch.cuda.current_stream()
        compute.wait_stream(self.copy)
        if self.record:
            gpu.record_stream(compute)
        return gpu


def _sin_chain_offloaded(record):
    offload = _OffloadWithCopyStream(record)
    x = torch.full((N,), 0.5, device="cuda", requires_grad=True)

    def forward():
        with offload:
            h1 = x.sin()  # saves x
            h2 = h1.sin()  # saves h1
        return h2.sum()

    loss = forward()
    loss.backward()  # h1 comes back, is read by SinBackward0 and freed; then x comes back from the same pool
    torch.cuda.synchronize()


def torchtune_unpacked_without_record_stream():
    """Models meta-pytorch/torchtune#1867 (NaN gradients with ``use_streams=True``: "a tensor deletion data race")
    and the hazard pytorch/pytorch#106360 describes: the unpacked activation, allocated on the copy stream, is freed
    after the backward op read it on the compute stream; the copy stream's next unpack can be handed its block while
    that read may still run."""
    _sin_chain_offloaded(record=False)


def torchtune_unpacked_recorded_on_compute_stream():
    """The fix of meta-pytorch/torchtune#1936 (``record_stream(s0)`` on the unpacked tensor when it can outlive its
    node): the allocator keeps the block until the compute stream's work is done."""
    _sin_chain_offloaded(record=True)


# ------------------------------------------------------------------ torchao CPUOffloadOptimizer
class _CPUOffloadOptimizer:
    """torchao's ``CPUOffloadOptimizer`` (torchao/optim/cpu_offload.py, ``offload_gradients=True``), reduced: each
    parameter has a pinned host copy with a pinned gradient; a post-accumulate-grad hook copies the gradient D2H on
    the offload stream and frees the GPU one; ``step()`` waits for each gradient's event, runs the optimizer on the
    host and copies the parameter back H2D on the offload stream. ``wait_for_backward``: the hook makes the offload
    stream wait for the current stream first (what pytorch/ao#584's review added)."""

    def __init__(self, params, wait_for_backward, lr=0.1):
        (self.stream,) = streams("offload")
        self.wait_for_backward = wait_for_backward
        self.host = {}
        self.optims = {}
        self.queue = {}
        for p in params:
            p_host = torch.empty_like(p, device="cpu", pin_memory=True)
            p_host.grad = torch.empty_like(p_host, pin_memory=True)
            p_host.copy_(p.detach(), non_blocking=True)
            self.host[p] = p_host
            p.register_post_accumulate_grad_hook(self._backward_hook)
            self.optims[p] = torch.optim.SGD([p_host], lr=lr)

    def _backward_hook(self, p):
        p_host = self.host[p]
        if self.wait_for_backward:
            self.stream.wait_stream(torch.cuda.current_stream())  # make sure backward for this param finishes
        with torch.cuda.stream(self.stream):
            p_host.grad.copy_(p.grad, non_blocking=True)
        self.queue[p] = self.stream.record_event()
        p.grad.record_stream(self.stream)  # free the GPU gradient once the D2H copy is done
        p.grad = None

    def step(self):
        with torch.no_grad():
            for p, event in self.queue.items():
                event.synchronize()
                self.optims[p].step()  # on the host
                with torch.cuda.stream(self.stream):
                    p.copy_(self.host[p], non_blocking=True)
            self.stream.synchronize()  # the parameters are back before the next forward
        self.queue.clear()


def _cpu_offload_training(wait_for_backward):
    w = torch.nn.Parameter(torch.full((N,), 1.0, device="cuda"))
    x = torch.full((N,), 0.5, device="cuda")
    opt = _CPUOffloadOptimizer([w], wait_for_backward)
    torch.cuda.synchronize()  # setup done
    for _ in range(2):
        loss = torch.dot(w, x)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()


def torchao_grad_offload_without_wait():
    """Models the bug found in review of pytorch/ao#584 (``CPUOffloadOptimizer``'s ``copy_grad_hook`` before the
    ``d2h_grad_stream.wait_stream(current_stream())`` it gained there): the offload stream copies the gradient while
    the backward op that writes it may still run, and its H2D parameter update overwrites the weight the forward on
    the default stream may still read."""
    _cpu_offload_training(wait_for_backward=False)


def torchao_grad_offload_waits_backward():
    """The fix from pytorch/ao#584's review, as torchao/optim/cpu_offload.py has it: the hook makes the offload stream
    wait for the current stream, which also orders the later H2D parameter copies after the forward."""
    _cpu_offload_training(wait_for_backward=True)


# ------------------------------------------------------------------ FSDP2 CPU offload with optimizer-in-backward
def _fsdp2_optimizer_in_backward(nonblocking_with_hooks):
    (reduce,) = streams("reduce")
    lr = 0.1
    sharded = torch.nn.Parameter(torch.full((N,), 1.0).pin_memory())  # CPUOffloadPolicy(pin_memory=True)
    hooks = [lambda p: p.add_(p.grad, alpha=-lr)]  # the optimizer-in-backward hook of torch/_tensor.py's example
    offload_events = []
    x = torch.full((N,), 0.5, device="cuda")
    unsharded = sharded.detach().to("cuda", non_blocking=True).requires_grad_()  # unshard: the H2D copy-in

    def post_backward(param):  # foreach_reduce for one rank: the reduce-scatter itself is left out
        reduce.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(reduce):
            sharded.grad = param.grad.to("cpu", non_blocking=nonblocking_with_hooks)
        offload_events.append(reduce.record_event())  # grad_offload_event
        with torch.no_grad():
            for hook in hooks:  # the sharded parameter's post-accumulate-grad hooks, run inside foreach_reduce
                hook(sharded)

    unsharded.register_post_accumulate_grad_hook(post_backward)
    loss = torch.dot(unsharded, x)
    loss.backward()
    for event in offload_events:  # finalize_backward
        event.synchronize()
    torch.cuda.synchronize()


def fsdp2_hook_reads_pending_grad_offload():
    """Models pytorch/pytorch#180666 (FSDP2 ``post_accumulate_grad_hook`` staleness under ``CPUOffloadPolicy``): the
    hook runs inside ``foreach_reduce`` right after the non-blocking D2H copy of the gradient was queued, and its
    host-side update reads the pinned gradient (and writes the pinned parameter) before anything waited for the
    copy, which ``grad_offload_event.synchronize()`` does only in ``finalize_backward``."""
    _fsdp2_optimizer_in_backward(nonblocking_with_hooks=True)


def fsdp2_hook_after_blocking_grad_offload():
    """The fix of pytorch/pytorch#180666: with post-accumulate-grad hooks registered the D2H copy is blocking, so the
    host has waited for it (and for what the reduce stream waited for) when the hook runs."""
    _fsdp2_optimizer_in_backward(nonblocking_with_hooks=False)


# ------------------------------------------------------------------ Lightning prediction writer
def _predict_epoch(non_blocking):
    model = torch.nn.Linear(256, 16).cuda()
    batches = [torch.full((64, 256), float(i)).pin_memory() for i in range(3)]  # DataLoader(pin_memory=True)
    predictions = []
    with torch.no_grad():
        for batch in batches:
            out = model(batch.to("cuda", non_blocking=True))
            predictions.append(out.to("cpu", non_blocking=non_blocking))  # move_data_to_device(..., "cpu")
    torch.save(predictions, io.BytesIO())  # BasePredictionWriter.write_on_epoch_end
    torch.cuda.synchronize()


def lightning_writer_saves_pending_d2h():
    """Models Lightning-AI/pytorch-lightning#11287 (``BasePredictionWriter`` writes zeros for the last batch): the
    predictions are moved to the CPU with ``non_blocking=True`` and the epoch-end writer saves them while the D2H
    copies may still be running."""
    _predict_epoch(non_blocking=True)


def lightning_writer_after_blocking_d2h():
    """The fix of Lightning-AI/pytorch-lightning#11288 ("Avoid non-blocking GPU->CPU copies"): the copy to the CPU
    is blocking."""
    _predict_epoch(non_blocking=False)


# ------------------------------------------------------------------ vLLM KV offloading vs zeroing of fresh blocks
def _kv_load_after_zeroing(wait_for_compute):
    (load,) = streams("load")
    NB, BS = 4, 4096
    kv = torch.ones(NB, BS, device="cuda")  # the KV pool: freed blocks hold stale data
    host_cache = torch.full((2, BS), 3.0).pin_memory()  # the CPU copies of two requests' prefixes
    q = torch.ones(BS, device="cuda")
    cur = torch.cuda.current_stream()
    load.wait_stream(cur)  # the pool exists before any transfer
    for step in range(2):
        blk = step + 1  # a block freshly allocated to a request whose prefix hits the CPU cache
        kv[blk].fill_(0.0)  # the model zeroes fresh blocks on the compute stream (needs_kv_cache_zeroing)
        if wait_for_compute:
            load.wait_stream(cur)
        with torch.cuda.stream(load):
            kv[blk].copy_(host_cache[step], non_blocking=True)  # the CPU->GPU load of the cached prefix
        loaded = torch.cuda.Event()
        loaded.record(load)
        cur.wait_event(loaded)  # the layer waits for its load
        score = torch.dot(kv[blk], q)
        del score
    torch.cuda.synchronize()


def vllm_kv_load_races_block_zeroing():
    """Models the bug vllm-project/vllm#50696 fixes (``SingleDirectionOffloadingHandler`` waited on the compute
    stream only for GPU->CPU transfers): the CPU->GPU load writes a freshly allocated block that the compute stream
    may still be zeroing, so the zeroing can land after the load and wipe the restored prefix (write after write;
    the read-side race of the same pool is kv_load_overwrites_block_in_use)."""
    _kv_load_after_zeroing(wait_for_compute=False)


def vllm_kv_load_waits_block_zeroing():
    """The fix of vllm-project/vllm#50696: loads, too, make the transfer stream wait for the compute stream."""
    _kv_load_after_zeroing(wait_for_compute=True)


SCENARIOS = [
    trl_offload_clones_on_transfer_stream, trl_offload_clones_on_compute_stream,
    trl_offload_waits_on_cached_stream, trl_offload_waits_on_current_stream,
    megatron_inline_reload_without_offload_event, megatron_inline_reload_waits_offload_event,
    torchtune_unpacked_without_record_stream, torchtune_unpacked_recorded_on_compute_stream,
    torchao_grad_offload_without_wait, torchao_grad_offload_waits_backward,
    fsdp2_hook_reads_pending_grad_offload, fsdp2_hook_after_blocking_grad_offload,
    lightning_writer_saves_pending_d2h, lightning_writer_after_blocking_d2h,
    vllm_kv_load_races_block_zeroing, vllm_kv_load_waits_block_zeroing,
]

# (kind, previous role, previous op, current role, current op) per scenario, in the order streamsan reports them
# (by the previous access's position in the trace).
EXPECTED = {
    # both steps: one finding, count 2
    "trl_offload_clones_on_transfer_stream": [
        ("device-device", "transfer", "aten::clone", "default", "aten::nll_loss_backward"),
    ],
    "trl_offload_clones_on_compute_stream": [],
    # the copy reads y before the compute stream wrote it; the freed y is pending for the compute stream's
    # allocation of step 2's y (the reuse, if any, is folded in)
    "trl_offload_waits_on_cached_stream": [
        ("device-device", "compute", "aten::exp", "transfer", "aten::copy_"),
        ("missing-record-stream", "transfer", "aten::copy_", "compute", "allocation"),
    ],
    "trl_offload_waits_on_current_stream": [],
    # the reload runs in the autograd engine's thread, on the default stream
    "megatron_inline_reload_without_offload_event": [
        ("device-device", "d2h", "aten::copy_", "default", "aten::_to_copy"),
    ],
    "megatron_inline_reload_waits_offload_event": [],
    "torchtune_unpacked_without_record_stream": [
        ("missing-record-stream", "default", "aten::cos", "copy", "allocation"),
    ],
    "torchtune_unpacked_recorded_on_compute_stream": [],
    # WAR on the weight (the forward's dot vs the H2D parameter update), then RAW on the gradient (the backward's mul
    # vs the hook's D2H copy); each in both steps
    "torchao_grad_offload_without_wait": [
        ("device-device", "default", "aten::dot", "offload", "aten::copy_"),
        ("device-device", "default", "aten::mul.Tensor", "offload", "aten::copy_"),
    ],
    "torchao_grad_offload_waits_backward": [],
    # the hook's add_ writes the pinned parameter the unshard's H2D copy read, and reads the pinned gradient the
    # reduce stream's D2H copy writes
    "fsdp2_hook_reads_pending_grad_offload": [
        ("host-device", "default", "aten::_to_copy", "host", "aten::add_.Tensor"),
        ("host-device", "reduce", "aten::_to_copy", "host", "aten::add_.Tensor"),
    ],
    "fsdp2_hook_after_blocking_grad_offload": [],
    # one finding for the three predictions (count 3)
    "lightning_writer_saves_pending_d2h": [
        ("host-device", "default", "aten::_to_copy", "host", "torch.save"),
    ],
    "lightning_writer_after_blocking_d2h": [],
    "vllm_kv_load_races_block_zeroing": [
        ("device-device", "default", "aten::fill_.Scalar", "load", "aten::copy_"),
    ],
    "vllm_kv_load_waits_block_zeroing": [],
}


test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED)
