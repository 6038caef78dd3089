"""Stream bugs of LLM serving engines, each as a small buggy program and its fix.

The patterns here are ones test_inference.py, test_offload_copies.py and test_host_staging.py lack: FlashInfer's
``plan()`` refilling its pinned int workspace while the previous plan's copy out of it may be pending (mini-sglang), the
shared experts of an MoE layer reading ``hidden_states`` on a side stream while the routed experts overwrite it in place
(vLLM), a synchronization event recorded before the speculative-decoding proposer's work (vLLM), a weight prefetcher
refilling a static buffer slot that a layer still needs (vLLM's prefetch offloader), sampling noise made on a side
stream and freed without ``record_stream`` (vLLM-Ascend), an MoE expert dispatcher whose expert stream is ordered with
neither its input nor its consumer (MoE-Infinity), and a LoRA adapter slot overwritten by an asynchronous load while the
previous batch still reads it. Every program is plain PyTorch with tensors of at most 1 << 16 elements; the engine code
is reduced to the lines that order (or fail to order) the streams, written for this file.

EXPECTED maps each scenario to the (kind, previous stream role, previous op, current stream role, current op) tuples
that docs/semantics.md implies, in the order streamsan reports them (by the previous access's position in the trace,
then the current one's); fixed programs expect ``[]``. Stream roles: "default" (the current stream), "host", and the
side streams each program names ("shared_experts", "prefetch", "sampling", "expert", "lora_load").
"""

import torch
from tests.gpu.support.scenario_kit import scenario_tests, streams



# ------------------------------------------------------------------ FlashInfer plan(): the pinned int workspace
PLAN_BATCH = 64


def _plan_steps(guard):
    """A FlashInfer wrapper's ``plan()`` per batch, reduced: the batch's index arrays (qo_indptr, kv_indptr,
    last_page_len) are packed into the wrapper's pinned int workspace and copied to its device workspace with
    ``non_blocking=True``; ``run()`` reads the device workspace. Under an overlap scheduler the next batch is planned
    before the previous one ran. ``guard``: None (the bug), "event" (the copy's event is synchronized before the
    pinned workspace is refilled) or "double" (two wrappers in turn, each reused after the event of its last copy)."""
    B = PLAN_BATCH
    wrappers = 2 if guard == "double" else 1
    host_ws = [torch.zeros(3 * (B + 1), dtype=torch.int32, pin_memory=True) for _ in range(wrappers)]
    copied = [torch.cuda.Event() for _ in range(wrappers)]
    dev_ws = torch.zeros(3 * (B + 1), dtype=torch.int32, device="cuda")
    kv_pages = torch.ones(1 << 16, device="cuda")
    for step in range(4):
        w = step % wrappers
        if guard is not None and step >= wrappers:
            copied[w].synchronize()  # the copy that last read this pinned workspace is done
        seq_lens = torch.arange(step + 4, step + 4 + B, dtype=torch.int32)  # the scheduler's next batch (CPU)
        qo_indptr = torch.arange(B + 1, dtype=torch.int32)
        kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int32), seq_lens.cumsum(0, dtype=torch.int32)])
        last_page_len = torch.ones(B + 1, dtype=torch.int32)
        host_ws[w].copy_(torch.cat([qo_indptr, kv_indptr, last_page_len]))  # plan(): into the pinned workspace
        dev_ws.copy_(host_ws[w], non_blocking=True)  # plan(): cudaMemcpyAsync to the device workspace
        if guard is not None:
            copied[w].record()
        out = kv_pages.index_select(0, dev_ws.long())  # run(): the kernel reads the plan
        del out
    torch.cuda.synchronize()


def flashinfer_plan_refills_pinned_workspace():
    """Models the race sgl-project/mini-sglang#103 fixes ("Fix race condition in flashinfer backend", the illegal
    memory accesses of its overlap scheduling): FlashInfer's ``plan()`` copies the batch metadata into the wrapper's
    internal pinned buffer and launches ``cudaMemcpyAsync`` to the device buffer; the next ``plan()`` overwrites the
    pinned buffer while the previous copy out of it may not have run yet."""
    _plan_steps(guard=None)


def flashinfer_plan_waits_previous_copy():
    """The fix alibaba/rtp-llm#1254 proposed (``_wait_for_plan_copies``: an event recorded after plan's copies,
    waited for before the pinned inputs are reused): the host synchronizes the previous copy's event before the next
    ``plan()`` refills the pinned workspace."""
    _plan_steps(guard="event")


def flashinfer_plan_double_buffered():
    """The scheme of mstar-project/mstar#236's review: two FlashInfer wrappers used in turn, and before step N+2 is
    planned the host waits for step N's completion event, so each pinned workspace is refilled only after the copy
    that last read it; the other wrapper's copy may still be pending meanwhile."""
    _plan_steps(guard="double")


# ------------------------------------------------------------------ vLLM shared experts on a side stream
def _shared_expert_overlap(clone_input):
    (shared,) = streams("shared_experts")
    T, D = 256, 128
    w_shared = torch.full((D, D), 1.0 / D, device="cuda")
    w_routed = torch.full((D, D), 2.0 / D, device="cuda")
    cur = torch.cuda.current_stream()
    hidden = torch.ones(T, D, device="cuda")
    for _layer in range(2):
        x = hidden.clone() if clone_input else hidden  # the fix: a clone made on the current stream, before the fork
        shared.wait_stream(cur)
        with torch.cuda.stream(shared):
            shared_out = torch.mm(x, w_shared)  # the shared experts, overlapped with the routed ones
        if clone_input:
            x.record_stream(shared)
        routed = torch.mm(hidden, w_routed)
        hidden.copy_(routed)  # fused_experts(..., inplace=True): the routed output overwrites hidden_states
        cur.wait_stream(shared)
        hidden = hidden + shared_out  # combine
    torch.cuda.synchronize()


def vllm_shared_experts_read_hidden_states_being_overwritten():
    """Models the race vllm-project/vllm#28430 fixes (from #28419, found while investigating #28220): the shared
    experts run on ``shared_experts_stream`` over ``hidden_states`` while the routed experts, on the current stream,
    write their output over the same ``hidden_states`` in place (the in-place ``fused_experts`` vllm-project/vllm#28942
    describes), with no edge from the shared experts' read to that write."""
    _shared_expert_overlap(clone_input=False)


def vllm_shared_experts_read_a_clone():
    """The fix of vllm-project/vllm#28430: the hidden states are cloned on the current stream before switching streams,
    the side stream waits for the current one, and the clone is recorded on the side stream."""
    _shared_expert_overlap(clone_input=True)


# ------------------------------------------------------------------ vLLM speculative decoding: an event recorded early
def _spec_decode_steps(record_after_proposer):
    R, M = 64, 16
    block_table_cpu = torch.zeros(R, M, dtype=torch.int32, pin_memory=True)  # the persistent batch's block table
    block_table_gpu = torch.zeros(R, M, dtype=torch.int32, device="cuda")
    draft_table_gpu = torch.zeros(R, M, dtype=torch.int32, device="cuda")
    kv = torch.ones(R * M, 64, device="cuda")
    prepare_inputs_event = torch.cuda.Event()
    for step in range(3):
        if step:
            prepare_inputs_event.synchronize()  # synchronize_input_prep
        block_table_cpu[step].fill_(step + 1)  # _update_states: a request gets a new block
        block_table_gpu.copy_(block_table_cpu, non_blocking=True)  # _prepare_inputs
        if not record_after_proposer:
            prepare_inputs_event.record()  # execute_model's finally block
        hidden = kv.index_select(0, block_table_gpu.flatten())  # the target model
        # sample_tokens(): the MTP / EAGLE proposer builds its own inputs from the persistent block table
        draft_table_gpu.copy_(block_table_cpu, non_blocking=True)
        draft = kv.index_select(0, draft_table_gpu.flatten())
        if record_after_proposer:
            prepare_inputs_event.record()
        del hidden, draft
    torch.cuda.synchronize()


def vllm_spec_decode_event_before_proposer():
    """Models the race vllm-project/vllm#37132 and #40610 describe (async scheduling with MTP / EAGLE; #53613 is a
    later variant): ``prepare_inputs_event`` is recorded when ``execute_model`` ends, but the proposer's GPU work is
    enqueued later, from ``sample_tokens()``; the next batch's ``_update_states`` waits only for that event and
    edits the persistent block table the proposer's copy may still be reading."""
    _spec_decode_steps(record_after_proposer=False)


def vllm_spec_decode_event_after_proposer():
    """The fix vllm-project/vllm#37132 / #40610 proposed: the event is recorded again after ``sample_tokens()``, so
    the next batch waits for all of the step's GPU work, the proposer's included."""
    _spec_decode_steps(record_after_proposer=True)


# ------------------------------------------------------------------ vLLM prefetch offloader: static buffer slots
class _PrefetchOffloader:
    """vLLM's ``PrefetchOffloader`` (vllm/model_executor/offloader/prefetch.py), reduced: each offloaded module's weight
    lives in pinned host memory and runs from a static GPU buffer, slot ``index % prefetch_step``; after a module's
    forward, ``start_onload_to_static`` refills a slot for a later module on the copy stream and records that module's
    ``_copy_done_event``, which the module's forward waits for. ``fork``: the copy stream first waits for an event
    recorded on the compute stream (vLLM's "fork"). ``chain``: the refill target is the next module of the released
    slot's own chain (vllm-project/vllm#54975) instead of ``(index + prefetch_step) % len(modules)``."""

    def __init__(self, weights, prefetch_step, fork, chain):
        (self.copy_stream,) = streams("prefetch")
        self.weights = weights
        self.step = prefetch_step
        self.fork = fork
        self.chain = chain
        self.slots = [torch.empty_like(weights[0], device="cuda") for _ in range(prefetch_step)]
        self.done = [torch.cuda.Event() for _ in weights]
        for i in range(min(prefetch_step, len(weights))):
            self.start_onload(i)

    def next_target(self, index):
        n = len(self.weights)
        if not self.chain:
            return (index + self.step) % n
        same_slot = [j for j in range(n) if j % self.step == index % self.step]
        return same_slot[(same_slot.index(index) + 1) % len(same_slot)]

    def start_onload(self, index):
        if self.fork:
            fork_event = torch.cuda.Event()
            torch.cuda.current_stream().record_event(fork_event)
            self.copy_stream.wait_event(fork_event)
        with torch.cuda.stream(self.copy_stream):
            self.slots[index % self.step].copy_(self.weights[index], non_blocking=True)
        self.done[index].record(self.copy_stream)

    def forward(self, index, h):
        torch.cuda.current_stream().wait_event(self.done[index])  # wait_prefetch
        out = torch.mm(h, self.slots[index % self.step])
        self.start_onload(self.next_target(index))  # start_prefetch
        return out


def _offloaded_forwards(fork, chain):
    M, STEP, T, D = 3, 2, 64, 128  # three offloaded modules, prefetch_step=2: modules 0 and 2 share slot 0
    weights = [torch.full((D, D), (i + 1) / D).pin_memory() for i in range(M)]
    offloader = _PrefetchOffloader(weights, STEP, fork=fork, chain=chain)
    h = torch.ones(T, D, device="cuda")
    for _ in range(2):
        for i in range(M):
            h = offloader.forward(i, h)
    torch.cuda.synchronize()


def vllm_offloader_refill_wraps_into_shared_slot():
    """Models vllm-project/vllm#54975 (reported for Ascend as vllm-project/vllm-ascend#10932): with three offloaded
    modules and ``prefetch_step=2`` the refill target of module 1 is module 0, whose slot 0 module 2 has not used yet;
    module 2 waits only for its own copy, so it reads slot 0 with no edge from the refill that overwrites it."""
    _offloaded_forwards(fork=True, chain=False)


def vllm_offloader_refill_without_compute_fork():
    """The hazard the comment in vLLM's ``start_onload_to_static`` names ("We must wait for the compute stream before
    copying, because the previous layer's forward may still be using the buffer"): without the fork event the copy
    stream refills a slot the layer that just ran may still be reading."""
    _offloaded_forwards(fork=False, chain=True)


def vllm_offloader_refill_within_slot_chain():
    """The fix of vllm-project/vllm#54975 with vLLM's fork: a slot is refilled only for the next module of its own
    chain, after the compute stream's fork event."""
    _offloaded_forwards(fork=True, chain=True)


# ------------------------------------------------------------------ vLLM-Ascend sampler: noise on a side stream
def _gumbel_sampling_steps(record):
    (sampling,) = streams("sampling")  # vLLM-Ascend's global_stream()
    B, V = 16, 4096
    logits = torch.zeros(B, V, device="cuda")
    cur = torch.cuda.current_stream()
    tokens = []
    for step in range(3):
        probs = (logits + step).softmax(dim=-1)
        with torch.cuda.stream(sampling):
            q = torch.empty_like(probs)  # allocated from the sampling stream's pool
            q.exponential_()
        cur.wait_stream(sampling)
        if record:
            q.record_stream(cur)
        tokens.append(probs.div_(q).argmax(dim=-1))  # Gumbel-max: argmax(p / q)
    torch.cuda.synchronize()


def vllm_ascend_sampler_noise_without_record_stream():
    """Models the bug vllm-project/vllm-ascend#13400 fixes (with its sibling backports #13397 / #13402 / #13404;
    ``inf`` log-probs in Qwen3-30B RL sampling): ``random_sample()`` makes the exponential noise ``q`` on
    ``global_stream()`` and divides by it on the current stream after ``wait_stream``, which orders the work but not
    the allocator: the next step's ``q`` can take the block while the previous division may still read it."""
    _gumbel_sampling_steps(record=False)


def vllm_ascend_sampler_noise_recorded():
    """The fix of vllm-project/vllm-ascend#13400: ``q.record_stream(current_stream())``."""
    _gumbel_sampling_steps(record=True)


# ------------------------------------------------------------------ MoE-Infinity expert dispatch
def _expert_dispatch(ordered):
    (expert,) = streams("expert")
    E, T, D = 4, 256, 64
    per = T // E
    experts = torch.full((E, D, D), 1.0 / D, device="cuda")  # resident expert weights
    perm = torch.arange(T).view(per, E).t().reshape(-1).to("cuda")  # top-1 routing: token t to expert t % E
    final = torch.zeros(T, D, device="cuda")  # the dispatcher's final_hidden_states
    hidden = torch.ones(T, D, device="cuda")
    torch.cuda.synchronize()  # the model and the dispatcher are set up
    cur = torch.cuda.current_stream()
    x_sorted = hidden.index_select(0, perm)  # the experts' inputs, gathered on the current stream
    if ordered:
        expert.wait_stream(cur)
    with torch.cuda.stream(expert):  # the dispatcher's exec stream
        for e in range(E):
            out = torch.mm(x_sorted[e * per:(e + 1) * per], experts[e])
            final.index_add_(0, perm[e * per:(e + 1) * per], out)
    if ordered:
        cur.wait_stream(expert)  # Wait(): the accumulation has run, not only been enqueued
    y = hidden + final  # the layer's consumer
    del y
    torch.cuda.synchronize()


def moe_infinity_expert_stream_unordered():
    """Models EfficientMoE/MoE-Infinity#197 (all-NaN logits from prefill step 0 once the allocator was NaN-poisoned):
    ``ExpertDispatcher`` builds the expert input on the default stream and runs the expert kernel on a non-blocking
    exec stream with no ordering between them (the input race), and ``Wait()`` returns once the accumulation into
    ``final_hidden_states`` is enqueued, so the caller reads it while ``index_add_`` may still run (the output race)."""
    _expert_dispatch(ordered=False)


def moe_infinity_expert_stream_ordered():
    """The fix of EfficientMoE/MoE-Infinity#197: the exec stream waits for the stream that produced the input, and the
    consumer's stream waits for the exec stream before reading the output."""
    _expert_dispatch(ordered=True)


# ------------------------------------------------------------------ LoRA adapter slot loaded on a side stream
def _lora_swaps(wait_forward):
    (load,) = streams("lora_load")
    T, D, R = 64, 512, 16
    adapters = [torch.full((D, R), 0.01 * (i + 1)).pin_memory() for i in range(4)]  # the CPU adapter cache
    lora_a = torch.zeros(1, D, R, device="cuda")  # max_loras=1: one GPU slot
    x = torch.ones(T, D, device="cuda")
    cur = torch.cuda.current_stream()
    load.wait_stream(cur)  # the slot exists before any load
    loaded = torch.cuda.Event()
    forward_done = torch.cuda.Event()

    def activate(i):
        with torch.cuda.stream(load):
            if wait_forward:
                load.wait_event(forward_done)  # the batch that used the evicted adapter has read the slot
            lora_a[0].copy_(adapters[i], non_blocking=True)
            loaded.record(load)

    activate(0)
    for step in range(3):
        cur.wait_event(loaded)  # the forward waits for its adapter
        shrink = torch.mm(x, lora_a[0])  # the LoRA shrink reads the slot
        forward_done.record()
        activate(step + 1)  # the next batch's adapter evicts this one while this forward may still run
        del shrink
    torch.cuda.synchronize()


def lora_slot_loaded_during_forward():
    """A common pattern, not a reported bug: overlapped LoRA loading copies adapter weights H2D into a GPU slot on a
    loading stream and makes the forward wait for the load's event (the arrangement of vllm-project/vllm#41785 and of
    SGLang's ``LoRAOverlapLoader``). Here the reverse edge is missing: the loading stream never waits for the forward,
    so evicting an adapter overwrites the slot while the previous batch's forward may still read it (write after
    read)."""
    _lora_swaps(wait_forward=False)


def lora_slot_loaded_after_forward():
    """The fix: the loading stream first waits for an event recorded after the forward that read the evicted
    adapter; the load still overlaps with whatever the default stream does next."""
    _lora_swaps(wait_forward=True)


SCENARIOS = [
    flashinfer_plan_refills_pinned_workspace, flashinfer_plan_waits_previous_copy, flashinfer_plan_double_buffered,
    vllm_shared_experts_read_hidden_states_being_overwritten, vllm_shared_experts_read_a_clone,
    vllm_spec_decode_event_before_proposer, vllm_spec_decode_event_after_proposer,
    vllm_offloader_refill_wraps_into_shared_slot, vllm_offloader_refill_without_compute_fork,
    vllm_offloader_refill_within_slot_chain,
    vllm_ascend_sampler_noise_without_record_stream, vllm_ascend_sampler_noise_recorded,
    moe_infinity_expert_stream_unordered, moe_infinity_expert_stream_ordered,
    lora_slot_loaded_during_forward, lora_slot_loaded_after_forward,
]

# (kind, previous role, previous op, current role, current op) per scenario, in the order streamsan reports them
# (by the previous access's position in the trace).
EXPECTED = {
    # the host's refill of step N+1 vs step N's H2D copy out of the pinned workspace (count 3)
    "flashinfer_plan_refills_pinned_workspace": [
        ("host-device", "default", "aten::copy_", "host", "aten::copy_"),
    ],
    "flashinfer_plan_waits_previous_copy": [],
    "flashinfer_plan_double_buffered": [],
    # write after read: the routed experts' in-place write vs the shared experts' read (count 2, one per layer)
    "vllm_shared_experts_read_hidden_states_being_overwritten": [
        ("device-device", "shared_experts", "aten::mm", "default", "aten::copy_"),
    ],
    "vllm_shared_experts_read_a_clone": [],
    # the host's edit of step N+1 vs the proposer's copy of step N, enqueued after the event (count 2)
    "vllm_spec_decode_event_before_proposer": [
        ("host-device", "default", "aten::copy_", "host", "aten::fill_.Scalar"),
    ],
    "vllm_spec_decode_event_after_proposer": [],
    # read after write: module 2 reads slot 0 after module 0's refill overwrote it (count 2, one per forward)
    "vllm_offloader_refill_wraps_into_shared_slot": [
        ("device-device", "prefetch", "aten::copy_", "default", "aten::mm"),
    ],
    # write after read: every refill vs the forward that just read the slot (count 6)
    "vllm_offloader_refill_without_compute_fork": [
        ("device-device", "default", "aten::mm", "prefetch", "aten::copy_"),
    ],
    "vllm_offloader_refill_within_slot_chain": [],
    # step 0's q is freed at step 1; the sampling stream's allocation of step 2's q is not ordered after step 0's
    # division (the reuse of the block, if any, is folded in)
    "vllm_ascend_sampler_noise_without_record_stream": [
        ("missing-record-stream", "default", "aten::div_.Tensor", "sampling", "allocation"),
    ],
    "vllm_ascend_sampler_noise_recorded": [],
    # the input race (each expert's GEMM vs the gather, count 4), then the output race (the consumer vs the last
    # accumulation)
    "moe_infinity_expert_stream_unordered": [
        ("device-device", "default", "aten::index_select", "expert", "aten::mm"),
        ("device-device", "expert", "aten::index_add_", "default", "aten::add.Tensor"),
    ],
    "moe_infinity_expert_stream_ordered": [],
    # write after read: each load vs the forward that read the evicted adapter (count 3)
    "lora_slot_loaded_during_forward": [
        ("device-device", "default", "aten::mm", "lora_load", "aten::copy_"),
    ],
    "lora_slot_loaded_after_forward": [],
}


test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED)
