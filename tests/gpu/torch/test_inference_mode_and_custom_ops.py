"""Three ways an op's schema hid what it did on the GPU, each missed before (found by programs streamsan's authors
had not seen): in inference mode, composite ops (``to``, ``reshape``, ``contiguous``) reached the tracer whole and
their copies were not seen; a custom op implemented in Python that switches streams was one op on the caller's
stream; and ``record_stream`` on a torch tensor over CuPy memory was taken as protecting it."""

import pytest
import torch

N = 1 << 18
SPIN = 5_000_000


def _d2h_in_inference_mode(synchronize):
    copy_stream = torch.cuda.Stream()
    x = torch.arange(N, device="cuda")
    with torch.inference_mode():
        copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(copy_stream):
            torch.cuda._sleep(SPIN)
            host = x.to("cpu", non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        if synchronize:
            done.synchronize()
        values = host.tolist()
    torch.cuda.synchronize()
    return values


@pytest.mark.parametrize("synchronize, expected", [
    (False, [("host-device", "copy_stream", "aten::_to_copy", "host", "Tensor.tolist")]),
    (True, []),
])
def test_a_non_blocking_copy_to_the_host_in_inference_mode(san, synchronize, expected):
    _, got = san(_d2h_in_inference_mode, synchronize)
    assert got == expected


def _side_write_then_composite(convert):
    side = torch.cuda.Stream()
    x = torch.zeros(512, 512, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN)
        x.fill_(1.0)
    with torch.inference_mode():
        y = convert(x)  # never waits for side
    torch.cuda.synchronize()
    return y


@pytest.mark.parametrize("convert, expected", [
    (lambda x: x.t().reshape(-1), [("device-device", "side", "aten::fill_.Scalar", "default", "aten::clone")]),
    (lambda x: x.t().contiguous(), [("device-device", "side", "aten::fill_.Scalar", "default", "aten::clone")]),
    (lambda x: x.to(torch.float16), [("device-device", "side", "aten::fill_.Scalar", "default",
                                      "aten::_to_copy")]),
    (lambda x: x.reshape(-1), []),  # a view: no access
    (lambda x: torch.nn.functional.dropout(x, 0.5, training=False), []),  # x itself: no access
])
def test_composite_ops_in_inference_mode(san, convert, expected):
    _, got = san(_side_write_then_composite, convert)
    assert got == expected


_AUX = {"join": False}


@torch.library.custom_op("streamsan_gpu_test::scaled_on_aux", mutates_args=())
def scaled_on_aux(x: torch.Tensor) -> torch.Tensor:
    aux = torch.cuda.Stream()
    aux.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(aux):
        torch.cuda._sleep(SPIN)
        out = x * 2
    if _AUX["join"]:
        torch.cuda.current_stream().wait_stream(aux)
        out.record_stream(torch.cuda.current_stream())
    return out


@scaled_on_aux.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.parametrize("join, expected", [
    (False, [("device-device", "aux", "aten::mul.Tensor", "default", "aten::add.Tensor")]),
    (True, []),
])
def test_a_custom_op_that_switches_streams(san, join, expected):
    def program():
        _AUX["join"] = join
        x = torch.ones(N, device="cuda")
        y = torch.ops.streamsan_gpu_test.scaled_on_aux(x)
        z = y + 1  # on the default stream: waits for aux only with the join
        torch.cuda.synchronize()
        return z

    _, got = san(program)
    assert got == expected


def test_record_stream_does_not_protect_cupy_memory(san):
    cp = pytest.importorskip("cupy")

    def program():
        cp_stream = cp.cuda.Stream(non_blocking=True)
        reader = torch.cuda.Stream()
        with cp_stream:
            base = cp.arange(N, dtype=cp.float32)
        cp_stream.synchronize()
        sums = []
        for step in range(3):
            with cp_stream:
                feat = cp.sin(base * (step + 1))
                with torch.cuda.stream(reader):
                    t = torch.from_dlpack(feat)
                    torch.cuda._sleep(SPIN)
                    sums.append(t.sum())
                    t.record_stream(reader)  # does nothing: CuPy's memory
            del t, feat
        torch.cuda.synchronize()

    _, got = san(program)
    assert got and {g[0] for g in got} == {"missing-record-stream"}
    assert {(g[1], g[3], g[4]) for g in got} == {("reader", "cp_stream", "allocation")}


@torch.library.custom_op("streamsan_gpu_test::opaque_scale", mutates_args=())
def opaque_scale(x: torch.Tensor) -> torch.Tensor:
    with torch._C._DisableTorchDispatch():  # (a pybind extension's kernel, as flash-attn's custom ops wrap theirs)
        return x * 3


@opaque_scale.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_custom_op_whose_work_is_not_seen_is_one_access_by_its_schema(san):
    def program():
        side = torch.cuda.Stream()
        x = torch.zeros(N, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN)
            x.fill_(1.0)
        y = torch.ops.streamsan_gpu_test.opaque_scale(x)  # never waits for side
        torch.cuda.synchronize()
        return y

    _, got = san(program)
    assert got == [("device-device", "side", "aten::fill_.Scalar", "default", "streamsan_gpu_test::opaque_scale")]
