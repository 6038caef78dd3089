"""NCCL collectives in a one-process group: a collective runs on NCCL's stream after waiting for the current
stream, so using its tensor before ``work.wait()`` races and after it is clean."""

import pytest
import torch
import torch.distributed as dist
from tests.gpu.support.scenario_kit import one_process_group


N = 1 << 16

if not dist.is_available() or not dist.is_nccl_available():
    pytest.skip("needs NCCL", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def group():
    with one_process_group():
        yield


def async_allreduce_then_use():
    x = torch.ones(N, device="cuda")
    dist.all_reduce(x, async_op=True)
    x.mul_(2.0)  # no work.wait(): NCCL may still be writing x
    torch.cuda.synchronize()


def async_allreduce_wait_then_use():
    x = torch.ones(N, device="cuda")
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    x.mul_(2.0)
    torch.cuda.synchronize()


def sync_allreduce_then_use():
    x = torch.ones(N, device="cuda")
    dist.all_reduce(x)
    x.mul_(2.0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("scenario, expected", [
    (async_allreduce_then_use, [("device-device", "c10d::allreduce_", "default", "aten::mul_.Tensor")]),
    (async_allreduce_wait_then_use, []),
    (sync_allreduce_then_use, []),
], ids=lambda x: getattr(x, "__name__", ""))
def test_collective(san, scenario, expected):
    _, got = san(scenario)
    assert [(k, pop, cur_role, cur_op) for k, _, pop, cur_role, cur_op in got] == expected
