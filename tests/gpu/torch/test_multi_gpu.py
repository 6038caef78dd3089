"""Two devices: a cross-device copy is ordered with both devices' current streams by the barrier PyTorch puts
around it; work on another stream of the destination device is not. Skipped with fewer than two GPUs."""

import pytest
import torch

import streamsan

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

N = 1 << 16


def copy_after_destination_write():
    src = torch.ones(N, device="cuda:0")
    dst = torch.empty(N, device="cuda:1")
    with torch.cuda.device(1):
        dst.fill_(2.0)  # on device 1's current stream: the copy's barrier orders it
    dst.copy_(src)
    with torch.cuda.device(1):
        dst.add_(1.0)  # after the completion barrier
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)


def copy_after_destination_side_stream_write():
    src = torch.ones(N, device="cuda:0")
    dst = torch.empty(N, device="cuda:1")
    with torch.cuda.device(1):
        torch.cuda.current_stream().synchronize()
        side = torch.cuda.Stream()
        streamsan.name_stream(side, "side")
        with torch.cuda.stream(side):
            dst.fill_(2.0)  # no barrier covers device 1's side stream
    dst.copy_(src)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)


@pytest.mark.parametrize("scenario, expected", [
    (copy_after_destination_write, []),
    (copy_after_destination_side_stream_write,
     [("device-device", "side", "aten::fill_.Scalar", "default", "aten::copy_")]),
], ids=lambda x: getattr(x, "__name__", ""))
def test_cross_device_copy(san, scenario, expected):
    _, got = san(scenario)
    assert got == expected


def data_parallel_training():
    """nn.DataParallel over both GPUs: replicas broadcast from device 0, run in threads on each device's current
    stream, outputs gathered back; must come out clean."""
    model = torch.nn.DataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                                      torch.nn.Linear(64, 4)).cuda(0), device_ids=[0, 1])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        x, y = torch.randn(32, 64, device="cuda:0"), torch.randn(32, 4, device="cuda:0")
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)


def test_data_parallel_training_is_clean(san):
    """Clean, with the replicas' work on device 1 traced (its ops run in DataParallel's threads and the autograd
    engine's device threads)."""
    session, got = san(data_parallel_training)
    assert got == []
    devices = {a.device for a in session.analyzer.agents.values() if getattr(a, "device", None) is not None}
    assert {0, 1} <= devices, devices
    assert session.analyzer.counts["ops"] > 50
