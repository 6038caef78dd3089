"""Stream bugs of inference and model-offloading code, each as a small buggy program and its fix.

Every pair reproduces the pattern of a real bug (named in the docstring: project, issue / PR, what raced) with
plain PyTorch (tensors of at most 1 << 16 elements): no model downloads, no engine code. The buggy function
must give exactly the findings in EXPECTED (kind, previous stream role, previous op, current stream role,
current op); the fixed one must give none.
Stream roles: "default" (the current stream), "host", and the side streams each program names ("copy",
"offload", "load", "forward", "plan", "transfer").

Three fixed programs at the end of the EXPECTED table are correct programs written the way vLLM writes them,
where a coarser model would report a race: a NumPy view made while a copy runs and read after waiting for it;
completion learned by polling a generic ``torch.Event``; a paged-cache write whose schema names the whole cache.
They expect ``[]`` because that is the truth. The last one is a known false report (KNOWN_FALSE_REPORTS): which
rows an ``index_copy_`` writes is in device memory, which streamsan never reads.
"""

import torch
from tests.gpu.support.scenario_kit import scenario_tests, streams



# ------------------------------------------------------------------ persistent pinned input buffers (H2D)
def _step_inputs(sync_before_refill):
    B, V, D = 256, 1024, 64
    ids_cpu = torch.zeros(B, dtype=torch.int64, pin_memory=True)
    pos_cpu = torch.zeros(B, dtype=torch.int64, pin_memory=True)
    ids_gpu = torch.zeros(B, dtype=torch.int64, device="cuda")
    pos_gpu = torch.zeros(B, dtype=torch.int64, device="cuda")
    emb = torch.ones(V, D, device="cuda")
    prepare_inputs_event = torch.cuda.Event()
    for step in range(3):
        if sync_before_refill and step:
            prepare_inputs_event.synchronize()  # the previous step's copies have read the pinned buffers
        ids_cpu.copy_(torch.full((B,), step + 1, dtype=torch.int64))  # the scheduler's new token ids
        torch.arange(step, step + B, out=pos_cpu)  # and positions
        ids_gpu.copy_(ids_cpu, non_blocking=True)
        pos_gpu.copy_(pos_cpu, non_blocking=True)
        if sync_before_refill:
            prepare_inputs_event.record()
        hidden = emb[ids_gpu] + pos_gpu.unsqueeze(1)  # the model step
        del hidden
    torch.cuda.synchronize()


def vllm_pinned_inputs_refilled_before_h2d():
    """Models vllm-project/vllm#24527 / #25279 (async scheduling CPU tensor race, gpu_model_runner.py): the
    persistent pinned input_ids / positions buffers are refilled for step N+1 while step N's non_blocking H2D
    copies of them may still be pending."""
    _step_inputs(sync_before_refill=False)


def vllm_pinned_inputs_refilled_after_event():
    """The fix of vllm-project/vllm#24527 / #25279: ``prepare_inputs_event`` is recorded after the copies and
    synchronized before the host touches the reused CPU tensors again."""
    _step_inputs(sync_before_refill=True)


# ------------------------------------------------------------------ block table / offsets edited in place
def _block_table_steps(mode):
    R, M, NB, D = 64, 32, 64, 64
    pinned = mode != "pageable"
    block_table = torch.zeros(R, M, dtype=torch.int64, pin_memory=pinned)
    kv = torch.ones(NB, D, device="cuda")
    for step in range(3):
        block_table[step].fill_(step + 1)  # the host remaps one request's blocks (prefix-cache hit, new block)
        src = block_table
        if mode == "fresh":
            src = torch.empty(R, M, dtype=torch.int64, pin_memory=True)  # a fresh staging buffer each step
            src.copy_(block_table)
        table_gpu = src.to("cuda", non_blocking=(mode != "blocking"))
        gathered = kv.index_select(0, table_gpu[:, 0])  # attention metadata reads the table
        del table_gpu, gathered
    torch.cuda.synchronize()


def block_table_edited_during_h2d():
    """Models NVIDIA/TensorRT-LLM#15546 (KV block offsets shipped from one persistent pinned host buffer
    overwritten in place every iteration under the overlap scheduler), also vllm-project/vllm#23737
    (paged_kv_indptr_cpu) and NVIDIA/Megatron-LM#5715 (pinned bookkeeping buffer): the host edits the pinned
    table while the previous step's non_blocking H2D copy of it may still be reading it."""
    _block_table_steps("pinned")


def block_table_fixed_pageable():
    """The fix of vllm-project/vllm#32799 ("don't pin reused flashinfer tensors"): a pageable source makes the
    H2D copy stage the data before returning, so the host may overwrite it at once."""
    _block_table_steps("pageable")


def block_table_fixed_blocking_copy():
    """The fix of NVIDIA/Megatron-LM#5715: the bookkeeping buffer is copied with a blocking H2D copy."""
    _block_table_steps("blocking")


def block_table_fixed_fresh_staging():
    """The fix of NVIDIA/TensorRT-LLM#15546 (and vllm-project/vllm-ascend#12079's copy_snapshot_to_gpu): each
    step stages the table into a fresh pinned buffer; the persistent one is never read by a stream."""
    _block_table_steps("fresh")


# ------------------------------------------------------------------ D2H results read by the host
def _accepted_tokens_steps(sync_before_read):
    B = 256
    accepted_gpu = torch.zeros(B, dtype=torch.int32, device="cuda")
    accepted_cpu = torch.zeros(B, dtype=torch.int32, pin_memory=True)
    copied = torch.cuda.Event()
    for step in range(3):
        if step:
            if sync_before_read:
                copied.synchronize()
            accepted_cpu.tolist()  # next step's attention metadata reads last step's counts
        accepted_gpu.fill_(step % 3 + 1)  # the rejection sampler's result for this step
        accepted_cpu.copy_(accepted_gpu, non_blocking=True)
        if sync_before_read:
            copied.record()
    torch.cuda.synchronize()


def vllm_accepted_tokens_read_before_d2h():
    """Models vllm-project/vllm#36013 (num_accepted_tokens under async scheduling): the count is copied D2H
    into a persistent pinned buffer with non_blocking=True and read by the host in the next step with no
    synchronization in between."""
    _accepted_tokens_steps(sync_before_read=False)


def vllm_accepted_tokens_read_after_event():
    """The fix of vllm-project/vllm#36013: an event recorded after the copy, synchronized before the read."""
    _accepted_tokens_steps(sync_before_read=True)


class _AsyncOutput:
    """A decode step's output copied to the host on a copy stream (vLLM's AsyncOutput, model runner V2)."""

    def __init__(self, sampled, copy_stream, keep_gpu_tensor, numpy_view=False):
        main = torch.cuda.current_stream()
        self.copy_event = torch.cuda.Event()
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_stream(main)
            cpu = sampled.to("cpu", non_blocking=True)
            self.sampled_cpu = cpu.numpy() if numpy_view else cpu  # numpy_view: vLLM's async_copy_to_np
            self.copy_event.record(copy_stream)
        self.sampled = sampled if keep_gpu_tensor else None

    def get_output(self):
        self.copy_event.synchronize()
        tokens = self.sampled_cpu.tolist()
        self.sampled = None  # the copy is done: the GPU tensor may go
        return tokens


def _async_output_loop(keep_gpu_tensor, numpy_view=False):
    (copy,) = streams("copy")
    B, D, V = 64, 128, 512
    h = torch.ones(B, D, device="cuda")
    w = torch.ones(D, V, device="cuda")

    def decode_step():
        logits = torch.mm(h, w)
        sampled = logits.argmax(dim=-1)
        return _AsyncOutput(sampled, copy, keep_gpu_tensor, numpy_view)

    pending = None
    results = []
    for _ in range(3):
        out = decode_step()  # step N+1 is launched before step N's output is collected (async scheduling)
        if pending is not None:
            results.append(pending.get_output())
        pending = out
    results.append(pending.get_output())
    torch.cuda.synchronize()


def vllm_async_output_drops_gpu_tensor():
    """Models vllm-project/vllm#29623 ("Keep reference to GPU tensors in AsyncOutput"; the same hazard as
    sgl-project/sglang#34076): the sampled token ids, allocated on the default stream, are copied D2H on a copy
    stream and then dropped; the default stream's next allocation may reuse the block while the copy runs."""
    _async_output_loop(keep_gpu_tensor=False)


def vllm_async_output_keeps_gpu_tensor():
    """The fix of vllm-project/vllm#29623: the output object keeps the GPU tensor until get_output() has
    synchronized the copy event."""
    _async_output_loop(keep_gpu_tensor=True)


def vllm_async_output_numpy_view():
    """A correct program: vllm-project/vllm's AsyncOutput as it is (vllm/v1/worker/gpu/async_utils.py,
    ``async_copy_to_np``): ``x.to("cpu", non_blocking=True).numpy()`` makes a NumPy view while the copy is
    pending, and the view is read only after ``copy_event.synchronize()``. ``Tensor.numpy()`` reads nothing."""
    _async_output_loop(keep_gpu_tensor=True, numpy_view=True)


# ------------------------------------------------------------------ KV-cache offload and load-back
def _kv_store_steps(wait_for_compute, paged_write=False):
    (offload,) = streams("offload")
    NB, BS = 4, 4096
    kv = torch.zeros(NB, BS, device="cuda")
    cpu_cache = torch.zeros(NB, BS, pin_memory=True)
    q = torch.ones(BS, device="cuda")
    for step in range(NB):
        new_kv = torch.full((BS,), float(step + 1), device="cuda")
        if paged_write:  # a paged-cache write kernel (reshape_and_cache-like): only the block's rows change
            kv.index_copy_(0, torch.full((1,), step, dtype=torch.int64, device="cuda"), new_kv.unsqueeze(0))
        else:
            kv[step].copy_(new_kv)  # the forward writes this step's KV block
        score = (kv[: step + 1] * q).sum()  # and attends over the blocks so far
        if wait_for_compute:
            offload.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(offload):
            cpu_cache[step].copy_(kv[step], non_blocking=True)  # store the finished block to the CPU cache
        del new_kv, score
    torch.cuda.synchronize()


def vllm_kv_store_before_compute():
    """Models vllm-project/vllm#31341 ("Wait for compute before offloading KV to CPU"; the same race in the
    SimpleCPUOffloadConnector is vllm-project/vllm#45704): the GPU->CPU store on the offload stream reads a KV
    block the compute stream may still be writing."""
    _kv_store_steps(wait_for_compute=False)


def vllm_kv_store_waits_compute():
    """The fix of vllm-project/vllm#31341: the offload stream waits for the compute stream before the store."""
    _kv_store_steps(wait_for_compute=True)


def vllm_kv_store_waits_compute_paged_write():
    """A correct program: the fix of vllm-project/vllm#31341 with the forward writing the cache through
    one whole-cache kernel (index_copy_, as vLLM's reshape_and_cache takes the whole key_cache). Step N+1's
    write touches only block N+1 while the store still reads block N: no common byte."""
    _kv_store_steps(wait_for_compute=True, paged_write=True)


def _kv_load_requests(wait_for_compute):
    (load,) = streams("load")
    NB, BS = 4, 4096
    kv = torch.zeros(NB, BS, device="cuda")
    host_cache = torch.ones(3, BS).pin_memory()
    q = torch.ones(BS, device="cuda")
    load.wait_stream(torch.cuda.current_stream())  # the KV pool exists before any transfer
    compute_done = torch.cuda.Event()
    for req in range(3):
        blk = 0  # the pool hands the block the previous request just released to the next one
        if wait_for_compute and req:
            load.wait_event(compute_done)
        with torch.cuda.stream(load):
            kv[blk].copy_(host_cache[req], non_blocking=True)  # load the request's cached prefix back
        loaded = torch.cuda.Event()
        loaded.record(load)
        torch.cuda.current_stream().wait_event(loaded)  # the layer waits for its load (wait_for_layer_load)
        score = torch.dot(kv[blk], q)  # attention over the loaded block
        if wait_for_compute:
            compute_done.record()
        del score
    torch.cuda.synchronize()


def kv_load_overwrites_block_in_use():
    """Models vllm-project/vllm#47282 (SimpleCPUOffload loads; fix proposed in #50863) and
    sgl-project/sglang#36738 (HiCache load-back): the host->device load on the load stream overwrites a reused
    KV block that the compute stream may still be reading for the previous request (write after read)."""
    _kv_load_requests(wait_for_compute=False)


def kv_load_waits_compute_done():
    """The fix of vllm-project/vllm#50863 (proposed) / sgl-project/sglang#36738 (merged): the load stream
    waits for a compute-done event (sglang: wait_stream on the forward stream) before writing reused blocks."""
    _kv_load_requests(wait_for_compute=True)


def vllm_kv_load_polled_with_torch_event():
    """A correct program: vllm-project/vllm's OffloadingConnector (vllm/v1/kv_offload/worker/cpu_gpu.py)
    ends each transfer with a generic ``torch.Event`` and get_finished() polls ``end_event.query()``; only a
    request whose load has completed is scheduled, so the compute stream reads the loaded block after it."""
    (load,) = streams("load")
    NB, BS = 4, 4096
    kv = torch.zeros(NB, BS, device="cuda")
    host_cache = torch.ones(1, BS).pin_memory()
    q = torch.ones(BS, device="cuda")
    load.wait_stream(torch.cuda.current_stream())
    end_event = torch.Event(enable_timing=True)
    with torch.cuda.stream(load):
        kv[0].copy_(host_cache[0], non_blocking=True)
        end_event.record(load)
    while not end_event.query():  # get_finished(): the job is reported done only once its event has completed
        pass
    score = torch.dot(kv[0], q)  # the request is scheduled in a later step and attends over the loaded block
    del score
    torch.cuda.synchronize()


# ------------------------------------------------------------------ overlap scheduler: schedule vs forward stream
def _overlap_schedule(wait_forward_done):
    (fwd,) = streams("forward")
    R, L = 16, 1024
    req_to_token = torch.zeros(R, L, dtype=torch.int64, device="cuda")
    kv_pool = torch.ones(4 * L, 8, device="cuda")
    rows = torch.arange(2, device="cuda")
    forward_done = torch.cuda.Event()
    cur = torch.cuda.current_stream()
    for i in range(3):
        slot = i % 2  # a finished request's slot is recycled for a new one
        if wait_forward_done and i:
            cur.wait_event(forward_done)
        req_to_token[slot].copy_(torch.arange(i, i + L, device="cuda"))  # prepare_for_decode
        fwd.wait_stream(cur)  # the forward reads what the schedule stream prepared
        with torch.cuda.stream(fwd):
            locs = req_to_token.index_select(0, rows)  # attention reads the request -> token table
            h = kv_pool.index_select(0, locs.flatten())
            out = h.sum()
        if wait_forward_done:
            forward_done.record(fwd)
        del locs, h, out
    torch.cuda.synchronize()


def sglang_req_to_token_written_during_forward():
    """Models sgl-project/sglang#18744 (fixes proposed in #18746 / #18803; the overlap WAR barrier landed in
    #26380 and was narrowed to a read-done event in #28363): the schedule (default) stream writes a recycled
    req_to_token row for the next batch while the forward stream may still be reading the table (WAR)."""
    _overlap_schedule(wait_forward_done=False)


def sglang_req_to_token_waits_forward_done():
    """The fix of sgl-project/sglang#18746 / #26380: an event recorded on the forward stream after the
    forward; the schedule stream waits for it before preparing the next batch."""
    _overlap_schedule(wait_forward_done=True)


def _eagle_plan_steps(wait_for_draft):
    (plan,) = streams("plan")
    BK, V, D = 128, 512, 32
    base = torch.ones(BK, V, device="cuda")
    emb = torch.ones(V, D, device="cuda")
    draft_buf = torch.zeros(BK, dtype=torch.int64, device="cuda")  # the plan stream's forward-batch buffer
    cur = torch.cuda.current_stream()
    plan.wait_stream(cur)  # the buffers exist before the plan stream uses them
    for step in range(3):
        draft = (base + step).argmax(dim=-1)  # draft tokens (build_tree) on the main stream
        if wait_for_draft:
            drafted = torch.cuda.Event()
            drafted.record()
            plan.wait_event(drafted)
        with torch.cuda.stream(plan):
            draft_buf.copy_(draft)  # populate_from_forward_batch: D2D copy of draft-dependent tensors
        cur.wait_stream(plan)
        verified = emb.index_select(0, draft_buf).sum()  # the target model verifies the draft
        del verified
    torch.cuda.synchronize()


def sglang_eagle_plan_reads_draft_early():
    """Models sgl-project/sglang#21942 (fix proposed in #22113; EAGLE v2 with the overlap plan stream): the
    plan stream copies draft tokens the main stream may still be writing, and overwrites its buffer while the
    previous verify may still read it."""
    _eagle_plan_steps(wait_for_draft=False)


def sglang_eagle_plan_waits_draft():
    """The fix proposed in sgl-project/sglang#22113: an event recorded on the main stream after the draft,
    waited for by the plan stream before populate_from_forward_batch."""
    _eagle_plan_steps(wait_for_draft=True)


# ------------------------------------------------------------------ diffusers group offloading with a stream
def _group_offload(sync_last_group, sync_before_offload, record=None):
    """Block-level group offloading with use_stream=True (diffusers hooks/group_offloading.py, reduced):
    each group's weights are pinned on the host; onload_() synchronizes the transfer stream (the previous
    prefetch), then copies the group with non_blocking=True on it; the next group is prefetched while the
    current one computes. record: None (record_stream=False), "current" (record_stream on
    torch.cuda.current_stream() looked up inside the transfer-stream context) or the compute stream."""
    (transfer,) = streams("transfer")
    G, per_group, B, D = 3, 2, 32, 128
    layers = [torch.nn.Linear(D, D, bias=False) for _ in range(G * per_group)]
    cpu_weights = []
    for layer in layers:
        w = torch.full((D, D), 1.0 / D).pin_memory()
        layer.weight.data = w
        cpu_weights.append(w)
    groups = [list(range(g * per_group, (g + 1) * per_group)) for g in range(G)]

    def onload(group):
        transfer.synchronize()  # wait for the previous host->device transfer
        with torch.cuda.stream(transfer):
            for i in group:
                layers[i].weight.data = cpu_weights[i].to("cuda", non_blocking=True)
                if record == "current":
                    layers[i].weight.data.record_stream(torch.cuda.current_stream())
                elif record is not None:
                    layers[i].weight.data.record_stream(record)

    def offload(group):
        if sync_before_offload:
            torch.cuda.current_stream().synchronize()  # the compute stream is done with the weights
        for i in group:
            layers[i].weight.data = cpu_weights[i]  # drops the GPU copy

    with torch.no_grad():
        h = torch.ones(B, D, device="cuda")
        onload(groups[0])
        for g in range(G):
            if g + 1 < G:
                onload(groups[g + 1])  # prefetch; its leading synchronize also covers this group's onload
            elif sync_last_group:
                transfer.synchronize()  # nothing prefetched: synchronize for this group's own onload
            for i in groups[g]:
                h = layers[i](h)
            offload(groups[g])
    torch.cuda.synchronize()


def diffusers_last_group_not_synchronized():
    """Models the bug huggingface/diffusers#12077 fixes (group offloading synchronization for a group with no
    next group to prefetch; the same missing edge as huggingface/diffusers#13502): the last group was onloaded
    asynchronously by the previous group's prefetch, and nothing synchronizes the transfer stream before it
    computes."""
    _group_offload(sync_last_group=False, sync_before_offload=True)


def diffusers_group_offload_synchronized():
    """The fix in huggingface/diffusers#12077 (synchronize the transfer stream when no next group is
    prefetched) with the record_stream=False offload guard (the compute stream is synchronized before the GPU
    weights are dropped, which huggingface/diffusers#14657 added to the disk path)."""
    _group_offload(sync_last_group=True, sync_before_offload=True)


def diffusers_offload_without_compute_sync():
    """Models huggingface/diffusers#14657 (offload to disk with record_stream=False): the GPU weights,
    allocated on the transfer stream and read by the compute stream, are dropped without synchronizing the
    compute stream; the transfer stream's next onload may be handed their blocks while compute still reads."""
    _group_offload(sync_last_group=True, sync_before_offload=False)


def diffusers_record_stream_on_transfer_stream():
    """Models huggingface/diffusers#12673 (fix PR #12721): with record_stream=True the onload called
    ``record_stream(torch.cuda.current_stream())`` inside ``torch.cuda.stream(transfer)``, i.e. on the
    allocating stream itself, a no-op; the weights are dropped while the compute stream may still read them."""
    _group_offload(sync_last_group=True, sync_before_offload=False, record="current")


def diffusers_record_stream_on_compute_stream():
    """The fix of huggingface/diffusers#12721: record_stream on the compute stream, looked up before entering
    the transfer-stream context."""
    _group_offload(sync_last_group=True, sync_before_offload=False, record=torch.cuda.current_stream())


SCENARIOS = [
    vllm_pinned_inputs_refilled_before_h2d, vllm_pinned_inputs_refilled_after_event,
    block_table_edited_during_h2d, block_table_fixed_pageable, block_table_fixed_blocking_copy,
    block_table_fixed_fresh_staging,
    vllm_accepted_tokens_read_before_d2h, vllm_accepted_tokens_read_after_event,
    vllm_async_output_drops_gpu_tensor, vllm_async_output_keeps_gpu_tensor,
    vllm_kv_store_before_compute, vllm_kv_store_waits_compute,
    kv_load_overwrites_block_in_use, kv_load_waits_compute_done,
    sglang_req_to_token_written_during_forward, sglang_req_to_token_waits_forward_done,
    sglang_eagle_plan_reads_draft_early, sglang_eagle_plan_waits_draft,
    diffusers_last_group_not_synchronized, diffusers_group_offload_synchronized,
    diffusers_offload_without_compute_sync, diffusers_record_stream_on_transfer_stream,
    diffusers_record_stream_on_compute_stream,
    vllm_async_output_numpy_view, vllm_kv_store_waits_compute_paged_write, vllm_kv_load_polled_with_torch_event,
]

EXPECTED = {
    "vllm_pinned_inputs_refilled_before_h2d": [
        ("host-device", "default", "aten::copy_", "host", "aten::copy_"),
        ("host-device", "default", "aten::copy_", "host", "aten::arange.start_out"),
    ],
    "vllm_pinned_inputs_refilled_after_event": [],
    "block_table_edited_during_h2d": [
        ("host-device", "default", "aten::_to_copy", "host", "aten::fill_.Scalar"),
    ],
    "block_table_fixed_pageable": [],
    "block_table_fixed_blocking_copy": [],
    "block_table_fixed_fresh_staging": [],
    "vllm_accepted_tokens_read_before_d2h": [
        ("host-device", "default", "aten::copy_", "host", "Tensor.tolist"),
    ],
    "vllm_accepted_tokens_read_after_event": [],
    "vllm_async_output_drops_gpu_tensor": [
        ("missing-record-stream", "copy", "aten::_to_copy", "default", "allocation"),
    ],
    "vllm_async_output_keeps_gpu_tensor": [],
    "vllm_kv_store_before_compute": [
        ("device-device", "default", "aten::copy_", "offload", "aten::copy_"),
    ],
    "vllm_kv_store_waits_compute": [],
    "kv_load_overwrites_block_in_use": [
        ("device-device", "default", "aten::dot", "load", "aten::copy_"),
    ],
    "kv_load_waits_compute_done": [],
    "sglang_req_to_token_written_during_forward": [
        ("device-device", "forward", "aten::index_select", "default", "aten::copy_"),
    ],
    "sglang_req_to_token_waits_forward_done": [],
    "sglang_eagle_plan_reads_draft_early": [
        ("device-device", "default", "aten::argmax", "plan", "aten::copy_"),  # RAW on the draft tokens
        ("device-device", "default", "aten::index_select", "plan", "aten::copy_"),  # WAR on the plan buffer
    ],
    "sglang_eagle_plan_waits_draft": [],
    "diffusers_last_group_not_synchronized": [
        ("device-device", "transfer", "aten::_to_copy", "default", "aten::mm"),
    ],
    "diffusers_group_offload_synchronized": [],
    "diffusers_offload_without_compute_sync": [
        ("missing-record-stream", "default", "aten::mm", "transfer", "allocation"),
    ],
    "diffusers_record_stream_on_transfer_stream": [
        ("missing-record-stream", "default", "aten::mm", "transfer", "allocation"),
    ],
    "diffusers_record_stream_on_compute_stream": [],
    # correct programs a coarser model gets wrong (see the module docstring)
    "vllm_async_output_numpy_view": [],
    "vllm_kv_store_waits_compute_paged_write": [],
    "vllm_kv_load_polled_with_torch_event": [],
}


KNOWN_FALSE_REPORTS = {
    "vllm_kv_store_waits_compute_paged_write": "reported: (device-device, offload, aten::copy_, default, "
                                               "aten::index_copy_); the rows index_copy_ writes are in device memory",
}


test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED, KNOWN_FALSE_REPORTS)
