"""Real transformers 5.x code paths under streamsan.watch(), with tiny random models built from configs (nothing is
downloaded): what streamsan must report on each, derived from the installed transformers source.

Most paths are correct library code and must come out clean; a report there is a false one. The offloaded caches
(``cache_implementation="offloaded"`` / ``"offloaded_static"``) have the two hazards of the offloaded cache: the prefetch
stream never waits for the default stream's device-to-host offload copy into pinned memory before its host-to-device
copy reads it back (``Cache.update`` only makes the default stream wait for the prefetch stream), and the prefetched
tensors, allocated on the prefetch stream and used on the default stream, are dropped without ``record_stream``. The
``DynamicCache(offloading=True)`` case itself is in test_transformers_cache.py; here it is reached through
``generate``, and the static variant is checked too. Continuous batching (``generate_batch``) fills its static IO
tensors on the default stream and never orders that before its side streams: real gaps too, asserted as found.

Each finding is (kind, previous role, previous op, current role, current op), here often with the two code
locations as well; stream roles: "default", "host", and the streams each test names itself after the run:
"prefetch_stream" (the offloaded caches'; the transformers hooks name it too, in every session of a process:
test_cache_hooks_name_and_label_in_every_session), "h2d_stream", "d2h_stream", "compute_stream" (continuous
batching's).
"""

import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) != 5:
    pytest.skip("written against transformers 5.x", allow_module_level=True)

import streamsan  # noqa: E402
from tests.gpu.support.transformers_lines import (CAT_K, CAT_V, OFFLOAD_K, OFFLOAD_V, PREFETCH_K,  # noqa: E402
                                                  PREFETCH_V, line_of)
from transformers.generation import utils as generation_utils  # noqa: E402
from transformers.integrations import sdpa_attention  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

PROMPT = 8
NEW = 4  # generated tokens: one prefill forward and three decode forwards


SDPA_CALL = line_of(sdpa_attention.sdpa_attention_forward, "torch.nn.functional.scaled_dot_product_attention(")
EAGER_QK = line_of(modeling_qwen3.eager_attention_forward, "torch.matmul(query, key_states")
EAGER_AV = line_of(modeling_qwen3.eager_attention_forward, "torch.matmul(attn_weights, value_states)")

# The pinned round trip of each offloaded layer: the default stream's D2H copy (offload) writes pinned memory that
# the prefetch stream's H2D copy (prefetch) reads with no edge between the two streams. One finding for keys, one
# for values.
PINNED_ROUND_TRIP = [
    ("device-device", "default", "aten::_to_copy", OFFLOAD_K, "prefetch_stream", "aten::_to_copy", PREFETCH_K),
    ("device-device", "default", "aten::_to_copy", OFFLOAD_V, "prefetch_stream", "aten::_to_copy", PREFETCH_V),
]
# StaticLayer.update writes the prefetched tensor in place on the default stream (index_copy_). When the prefetch
# stream's next H2D copy gets that tensor's freed block (its own pool), the copy's write races with that write too:
# the same missing record_stream as the attention's later read, so it is folded into that finding
# (docs/semantics.md, "Missing record_stream"; it was an alloc-reuse finding of its own before).


def tiny_model(arch="qwen3", attn="sdpa", dtype=torch.bfloat16, device="cuda"):
    """A 2-layer random model (hidden 64, vocab 1000), no EOS (every generate makes exactly NEW tokens)."""
    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=16, vocab_size=1000, attn_implementation=attn)
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model = model.to(device, dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    if device != "cpu":
        torch.cuda.synchronize()
    return model


def prompt(device="cuda"):
    ids = torch.randint(0, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    return ids.to(device)


def tiny_tokenizer():
    """A word-level fast tokenizer over "w0" ... "w999", built in memory."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(1000)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")


def located(session):
    """(kind, previous role, previous op, previous location, current role, current op, current location), sorted."""
    a = session.analyzer
    return sorted((f.kind, a.agents[f.previous.agent].name, f.previous.name, f.prev_loc,
                   a.agents[f.current.agent].name, f.current.name, f.cur_loc) for f in session.findings)


# ---------------------------------------------------------------------------------------------------- generate


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sample"])
def test_generate_default_cache_is_clean(san, arch, do_sample):
    """DynamicCache on the default stream only; StopCheck reads ``unfinished_sequences.max() == 0`` with a blocking
    ``bool()`` and hands no pinned memory to anyone (generation/utils.py StopCheck)."""
    model, ids = tiny_model(arch), prompt()
    out = []

    def run():
        out.append(model.generate(ids, max_new_tokens=NEW, do_sample=do_sample, top_k=50))

    _, got = san(run)
    assert got == []
    assert out[0].shape == (1, PROMPT + NEW)


def test_generate_static_cache_is_clean(san):
    """StaticCache writes its preallocated keys / values with index_copy_ on the default stream (cache_utils
    StaticLayer.update); the auto-compiled decode forward runs eagerly under the tracer."""
    model, ids = tiny_model(), prompt()
    out = []

    def run():
        out.append(model.generate(ids, max_new_tokens=NEW, do_sample=False, cache_implementation="static"))

    _, got = san(run)
    assert got == []
    assert out[0].shape == (1, PROMPT + NEW)


def offloaded_generate(san, cache_implementation, **model_kwargs):
    """``generate`` with an offloading cache under streamsan: (session, findings), its prefetch stream named."""
    model, ids = tiny_model(**model_kwargs), prompt()

    def run():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, cache_implementation=cache_implementation,
                             return_dict_in_generate=True)
        streamsan.name_stream(out.past_key_values.prefetch_stream, "prefetch_stream")

    return san(run)


def test_generate_offloaded_dynamic_cache(san):
    """``cache_implementation="offloaded"`` is ``DynamicCache(offloading=True)`` (generation/utils.py
    _prepare_cache_for_generation): the pinned round trip races, and the prefetched tensor is last read by the
    default stream's ``torch.cat`` in DynamicLayer.update before it is dropped, with no record_stream; the prefetch
    stream's next allocation (the next prefetch's keys) could get its block."""
    session, got = offloaded_generate(san, "offloaded")
    assert sorted(got) == sorted([
        ("device-device", "default", "aten::_to_copy", "prefetch_stream", "aten::_to_copy"),
        ("device-device", "default", "aten::_to_copy", "prefetch_stream", "aten::_to_copy"),
        ("missing-record-stream", "default", "aten::cat", "prefetch_stream", "allocation"),
        ("missing-record-stream", "default", "aten::cat", "prefetch_stream", "allocation"),
    ])
    assert located(session) == sorted(PINNED_ROUND_TRIP + [
        ("missing-record-stream", "default", "aten::cat", CAT_K, "prefetch_stream", "allocation", PREFETCH_K),
        ("missing-record-stream", "default", "aten::cat", CAT_V, "prefetch_stream", "allocation", PREFETCH_K),
    ])
    assert all(f.count > 1 for f in session.findings)  # one finding per code location, counted over layers and steps


def test_generate_offloaded_static_cache_eager(san):
    """``cache_implementation="offloaded_static"`` is ``StaticCache(offloading=True)``: the same Cache.update /
    offload / prefetch code as the dynamic one, so the same two hazards. The difference is who reads the prefetched
    tensor last: StaticLayer.update writes it in place (index_copy_) and returns it, Cache.offload copies it to the
    host, and the attention reads it after that (the layer dropped it, the local in Qwen3Attention.forward still holds
    it). With eager attention the last reads are the two ``torch.matmul``s of eager_attention_forward (aten::bmm),
    one line for keys and one for values. The in-place index_copy_'s races with the reuse are folded into those
    two findings (the same missing record_stream)."""
    session, got = offloaded_generate(san, "offloaded_static", attn="eager")
    assert sorted(got) == sorted([
        ("device-device", "default", "aten::_to_copy", "prefetch_stream", "aten::_to_copy"),
        ("device-device", "default", "aten::_to_copy", "prefetch_stream", "aten::_to_copy"),
        ("missing-record-stream", "default", "aten::bmm", "prefetch_stream", "allocation"),
        ("missing-record-stream", "default", "aten::bmm", "prefetch_stream", "allocation"),
    ])
    assert located(session) == sorted(PINNED_ROUND_TRIP + [
        ("missing-record-stream", "default", "aten::bmm", EAGER_QK, "prefetch_stream", "allocation", PREFETCH_K),
        ("missing-record-stream", "default", "aten::bmm", EAGER_AV, "prefetch_stream", "allocation", PREFETCH_K),
    ])
    assert all(f.count > 1 for f in session.findings)


def test_generate_offloaded_static_cache_sdpa(san):
    """The same with SDPA attention: keys and values are last read by one scaled_dot_product_attention call, so the
    two missing-record-stream hazards share one pair of code locations and are one finding (three in all). Which aten
    op SDPA dispatches to depends on the GPU and torch build, so that op is only checked to be an SDPA one."""
    session, _ = offloaded_generate(san, "offloaded_static", attn="sdpa")
    found = located(session)
    assert [x for x in found if x[0] != "missing-record-stream"] == sorted(PINNED_ROUND_TRIP)
    mrs = [x for x in found if x[0] == "missing-record-stream"]
    assert len(mrs) == 1
    kind, prev_role, prev_op, prev_loc, cur_role, cur_op, cur_loc = mrs[0]
    assert (prev_role, prev_loc, cur_role, cur_op, cur_loc) == (
        "default", SDPA_CALL, "prefetch_stream", "allocation", PREFETCH_K)
    assert prev_op.startswith("aten::_scaled_dot_product_"), prev_op  # _cudnn_attention on an H200, torch 2.11
    assert all(f.count > 1 for f in session.findings)


# ---------------------------------------------------------------------------------------------------- streamers


def test_text_iterator_streamer_in_a_thread_is_clean(san):
    """The documented TextIteratorStreamer pattern: tokenizer output moved with ``BatchEncoding.to(non_blocking=True)``
    (pageable source), ``generate`` in a background thread, the main thread iterating the streamer. The streamer only
    gets ``tokens.cpu()`` (a blocking copy into pageable memory, generation/utils.py StopCheck) through a queue."""
    model, tok = tiny_model(), tiny_tokenizer()
    seen = {}

    def run():
        inputs = tok(["w5 w17 w123 w999 w42 w7 w300 w8"], return_tensors="pt").to("cuda", non_blocking=True)
        streamer = transformers.TextIteratorStreamer(tok, skip_prompt=True, timeout=120)
        kwargs = dict(**inputs, streamer=streamer, max_new_tokens=NEW, do_sample=False)
        worker = threading.Thread(target=lambda: seen.setdefault("out", model.generate(**kwargs)))
        worker.start()
        seen["text"] = "".join(streamer)
        worker.join()

    _, got = san(run)
    assert got == []
    assert seen["out"].shape == (1, PROMPT + NEW)
    assert seen["text"] == tok.decode(seen["out"][0, PROMPT:].tolist())


class Collect(transformers.generation.streamers.BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.chunks.append(None)


def test_deferred_stop_check_on_cuda_is_clean(san, monkeypatch):
    """DeferredStopCheck (generation/utils.py), which transformers 5.17 enables on MPS only, forced on CUDA: it copies
    the stop flag and the tokens into two pinned slots with ``copy_(non_blocking=True)``, records a
    ``torch.Event(blocking=True)`` per slot, and reads a slot only after synchronizing its event, a step later. A
    correct double buffer: the host's read of a slot is ordered before the next copy into it (enqueued after), and
    after the copy that filled it (the event)."""
    model, ids = tiny_model(), prompt()
    expected = model.generate(ids, max_new_tokens=NEW, do_sample=False)  # StopCheck, untraced
    monkeypatch.setattr(generation_utils.DeferredStopCheck, "is_supported", staticmethod(lambda *a, **k: True))
    made = []
    real_init = generation_utils.DeferredStopCheck.__init__

    def init(self, *args, **kwargs):
        made.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(generation_utils.DeferredStopCheck, "__init__", init)
    streamer = Collect()
    out = []

    def run():
        out.append(model.generate(ids, max_new_tokens=NEW, do_sample=False, streamer=streamer))

    _, got = san(run)
    assert len(made) == 1 and made[0].slots[0][0].is_pinned()  # the deferred path ran, with pinned slots
    assert got == []
    assert torch.equal(out[0], expected)
    assert streamer.chunks[0] == ids.tolist() and streamer.chunks[-1] is None
    assert sum(streamer.chunks[1:-1], []) == expected[0, PROMPT:].tolist()


# ---------------------------------------------------------------------------------------------------- copies


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
def test_model_to_cuda_non_blocking_then_forward_is_clean(san, pinned):
    """``model.to("cuda", non_blocking=True)`` of a CPU model (nn.Module._apply swaps each parameter's data for its
    copy): the H2D copies run on the default stream, the forward after them on the same stream; nothing on the host
    touches the (pageable, or pinned) CPU weights afterwards."""
    model = tiny_model(dtype=torch.float32, device="cpu")
    if pinned:
        for t in list(model.parameters()) + list(model.buffers()):
            t.data = t.data.pin_memory()
    ids = prompt("cpu")
    with torch.no_grad():
        expected = model(ids).logits
    out = []

    def run():
        m = model.to("cuda", non_blocking=True)
        with torch.no_grad():
            out.append(m(ids.to("cuda")).logits.cpu())

    _, got = san(run)
    assert got == []
    torch.testing.assert_close(out[0], expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("how, expected", [
    ("blocking", []),  # .to("cpu"): a blocking copy into pageable memory
    ("non_blocking_synchronized", []),  # pinned, read after torch.cuda.synchronize()
    ("non_blocking_event", []),  # pinned, read after an event recorded after the copies is synchronized
    # pinned (a non_blocking D2H copy gets a pinned destination), read at once: the host reads bytes the default
    # stream may still be writing. One finding: the same two code lines for every hidden state.
    ("non_blocking_read_at_once", [("host-device", "default", "aten::_to_copy", "host", "Tensor.tolist")]),
])
def test_hidden_states_to_cpu(san, how, expected):
    """A forward with ``output_hidden_states=True`` (3 hidden states for 2 layers), each moved to the host and read
    with ``tolist()``."""
    model, ids = tiny_model(), prompt()
    out = []

    def run():
        with torch.no_grad():
            states = model(ids, output_hidden_states=True).hidden_states
        if how == "blocking":
            cpu = [h.to("cpu") for h in states]
        else:
            cpu = [h.to("cpu", non_blocking=True) for h in states]
            if how == "non_blocking_synchronized":
                torch.cuda.synchronize()
            elif how == "non_blocking_event":
                done = torch.cuda.Event()
                done.record()
                done.synchronize()
        out.append([c.tolist() for c in cpu])

    session, got = san(run)
    assert got == expected
    assert len(out[0]) == 3
    if expected:
        assert session.findings[0].count == 3


@pytest.mark.parametrize("how, expected", [
    ("pageable", []),
    ("pinned_synchronized", []),
    # the caller refills the pinned batch while the default stream's H2D copy (BatchEncoding.to) may still read it
    ("pinned_refilled_at_once", [("host-device", "default", "aten::_to_copy", "host", "aten::fill_.Scalar")]),
])
def test_batch_encoding_to_non_blocking(san, how, expected):
    """``BatchEncoding.to(device, non_blocking=True)`` (tokenization_utils_base.py) is ``v.to(device,
    non_blocking=...)`` for each tensor: from a pinned batch the copies are asynchronous, so reusing the pinned
    buffer for the next batch needs a synchronization first; from a pageable one nothing can race."""
    tok = tiny_tokenizer()
    enc = tok(["w5 w17 w123 w999 w42 w7 w300 w8"], return_tensors="pt")
    ids = enc["input_ids"].tolist()  # (the pageable case refills enc's own tensor)
    out = []

    def run():
        host = {k: (v.pin_memory() if how != "pageable" else v) for k, v in enc.items()}
        batch = transformers.BatchEncoding(dict(host)).to("cuda", non_blocking=True)
        if how == "pinned_synchronized":
            torch.cuda.current_stream().synchronize()
        host["input_ids"].fill_(0)  # the next batch, into the same buffer
        out.append(batch["input_ids"].cpu())

    session, got = san(run)
    assert got == expected
    if expected:
        assert session.findings[0].prev_loc.startswith("transformers/tokenization_utils_base.py:")
    else:
        assert out[0].tolist() == ids


# ------------------------------------------------------------------------------------------------ continuous batching


def cb_locations():
    """Code locations of generation/continuous_batching that the findings below name."""
    from transformers.generation.continuous_batching import cache, input_outputs, model_runner

    io = input_outputs.ContinuousBatchingIOs
    reset = io._reset_static_tensors
    return dict(
        prep_write=line_of(io.prepare_batch_tensors, "self.write_index_storage[i, : len(group_write_indices)] ="),
        prep_read=line_of(io.prepare_batch_tensors, "self.read_index_storage[i, : len(group_read_indices)] ="),
        cache_write_k=line_of(cache.PagedAttentionCache.update, "k_cache.index_copy_(0, layer_write_index"),
        cache_write_v=line_of(cache.PagedAttentionCache.update, "v_cache.index_copy_(0, layer_write_index"),
        cache_read_k=line_of(cache.PagedAttentionCache.update, "torch.index_select(k_cache, 0, layer_read_index)"),
        cache_read_v=line_of(cache.PagedAttentionCache.update, "torch.index_select(v_cache, 0, layer_read_index)"),
        setup_out=line_of(io._setup_static_tensors, "self.output_ids.zero_()"),
        reset_bulk=line_of(reset, "self._bulk_input_tensor[: self.static_inputs, : q_len + 1].zero_()"),
        reset_logits=line_of(reset, "self.logits_indices[:b_size].zero_()"),
        reset_out=line_of(reset, "self.output_ids[:, :b_size].zero_()"),
        reset_mask=line_of(reset, "self.attention_mask[layer_type][:, :, :q_len, : q_len + kv_len].fill_("),
        reset_write=line_of(reset, "self.write_index_storage[:, :q_len].fill_("),  # the full_reset branch
        reset_read=line_of(reset, "self.read_index_storage[:, : q_len + kv_len].fill_("),
        h2d_bulk=line_of(io._transfer_inputs, "other._bulk_input_tensor.copy_("),
        h2d_write=line_of(io._transfer_inputs, "other.write_index_storage.copy_("),
        h2d_read=line_of(io._transfer_inputs, "other.read_index_storage.copy_("),
        h2d_mask=line_of(io._transfer_inputs, "other.attention_mask[layer_type].copy_("),
        d2h_out=line_of(input_outputs.HostDeviceIOPair.transfer_outputs_d2h, "self.host_io.output_ids.copy_("),
        carry=line_of(input_outputs.ContinuousBatchingAsyncIOs.carry_over_tokens,
                      "carried_over_ids = prev_output_ids[0, carry_over_ids]"),
        sample_out=line_of(model_runner.ModelRunner._sample, "output_ids[0, :tokens].copy_(next_tokens)"),
    )


def cb_expected(async_batching):
    L = cb_locations()

    def dd(prev_op, prev, role, op, cur):
        return ("device-device", "default", prev_op, L[prev], role, op, L[cur])

    if not async_batching:
        # ContinuousBatchingIOs lives on the GPU: prepare_batch_tensors fills its static tensors on the manager
        # thread's current stream (the default one) with `static[...] = torch.tensor(list, device=...)`, and the model
        # runs on io.compute_stream (model_runner.py compute_batch: `with torch.cuda.stream(compute_stream)`), which
        # never waits for the default stream. Each torch.tensor(...) is a blocking H2D copy, so every slice copy but
        # the last ones before the forward is ordered by the next one's synchronization: what stays unordered is the
        # write / read index copy (the last of a batch, the read one skipped when empty) against the paged cache's
        # index_copy_ / index_select that consume them.
        return sorted([
            dd("aten::copy_", "prep_write", "compute_stream", "aten::index_copy_", "cache_write_k"),
            dd("aten::copy_", "prep_write", "compute_stream", "aten::index_copy_", "cache_write_v"),
            dd("aten::copy_", "prep_read", "compute_stream", "aten::index_select", "cache_read_k"),
            dd("aten::copy_", "prep_read", "compute_stream", "aten::index_select", "cache_read_v"),
        ])
    # ContinuousBatchingAsyncIOs: its device IO tensors are zeroed / filled on the default stream, once when made
    # (_setup_static_tensors, in warmup on the calling thread) and again by reset() (_reset_static_tensors, when the
    # manager thread takes the batch processor over). reset() then synchronizes the h2d, d2h and compute streams, not
    # the default stream, and nothing else orders the default stream before them (the host IO is on the CPU, so
    # there are no blocking copies): every first access of those tensors by the three streams races with the fills.
    # The carry-over gather reads output_ids at carry_over_ids, which the h2d stream copied from host memory: with
    # no token carried over (-1, the last column) it reads none of the columns reset() zeroes, only what setup zeroed.
    return sorted([
        dd("aten::zero_", "setup_out", "d2h_stream", "aten::copy_", "d2h_out"),
        dd("aten::zero_", "setup_out", "compute_stream", "aten::index.Tensor", "carry"),
        dd("aten::zero_", "reset_bulk", "h2d_stream", "aten::copy_", "h2d_bulk"),
        dd("aten::zero_", "reset_logits", "h2d_stream", "aten::copy_", "h2d_bulk"),
        dd("aten::zero_", "reset_out", "compute_stream", "aten::copy_", "sample_out"),
        dd("aten::zero_", "reset_out", "d2h_stream", "aten::copy_", "d2h_out"),
        dd("aten::fill_.Scalar", "reset_mask", "h2d_stream", "aten::copy_", "h2d_mask"),
        dd("aten::fill_.Scalar", "reset_write", "h2d_stream", "aten::copy_", "h2d_write"),
        dd("aten::fill_.Scalar", "reset_read", "h2d_stream", "aten::copy_", "h2d_read"),
    ])


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_continuous_batching_default_stream_gaps(san, async_batching):
    """``generate_batch`` (generation/continuous_batching), CUDA graphs off so the stream logic runs as written: the
    GPU work on the default stream (filling the static IO tensors) is never ordered before the side streams that use
    those tensors (compute; in async mode also h2d and d2h, which are otherwise chained correctly by the h2d_over /
    compute_over / d2h_over events). PyTorch's side streams do not synchronize with the default stream, so these are
    real ordering gaps of transformers 5.17 (an idle GPU hides them: the fills are enqueued first and are short).
    The streams are named after the run, from the manager the model keeps (persistent_manager=True)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = tiny_model()
    inputs = [prompt("cpu")[0].tolist(), prompt("cpu")[0, :5].tolist()]
    config = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(block_size=16, num_blocks=16, max_batch_tokens=64,
                                  use_async_batching=async_batching, use_cuda_graph=False)
    out = {}

    def run():
        out.update(model.generate_batch(inputs, generation_config=config, continuous_batching_config=cb,
                                        persistent_manager=True))
        torch.cuda.synchronize()
        io = model._cached_continuous_batching_manager.batch_processor.inputs_and_outputs
        for name in ("h2d_stream", "d2h_stream", "compute_stream"):
            if getattr(io, name, None) is not None:
                streamsan.name_stream(getattr(io, name), name)

    try:
        session, _ = san(run)
    finally:
        model.destroy_cached_continuous_batching_manager()
    assert len(out) == 2
    assert all(r.error is None and len(r.generated_tokens) == NEW for r in out.values())
    assert located(session) == cb_expected(async_batching)


# ---------------------------------------------------------------------------------------------------- the hooks


def test_cache_hooks_name_and_label_in_every_session():
    """Two sessions in one process, each decoding with DynamicCache(offloading=True): in each, the hooks must name
    the prefetch stream and label the cache layers (test_transformers_cache.py checks this in a fresh process). The
    hooks once served only the session that patched cache_utils: every later one (every test but the first under
    ``pytest --streamsan``) lost the stream's name and the labels."""
    model, ids = tiny_model(), prompt()

    def decode():
        cache = transformers.DynamicCache(config=model.config, offloading=True)
        with torch.no_grad():
            tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(2):
                tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()

    for i in range(2):
        torch.cuda.synchronize()
        with streamsan.watch() as session:
            decode()
        a = session.analyzer
        assert {a.agents[f.current.agent].name for f in session.findings} == {"prefetch_stream"}, f"session {i}"
        assert len(session.findings) == 4, f"session {i}"
        for race in session.report()["races"]:
            assert race["memory"]["label"].startswith("cache.layers["), f"session {i}"
            assert race["previous_access"]["context"].startswith("transformers Cache."), f"session {i}"
