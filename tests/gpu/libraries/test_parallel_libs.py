"""Real training code of PyTorch's own libraries on a GPU, which must come out clean: DDP, FSDP (both APIs),
tensor parallelism (DTensor), activation checkpointing and mixed precision, each for a few steps in a
one-process NCCL group.

These libraries order their streams carefully (DDP's gradient buckets and allreduce, FSDP's all-gather and
reduce-scatter streams with events, ``record_stream`` under ``no_dispatch()`` and storage resizing), so any
finding here is a false report. The backward ops run in the autograd engine's own thread.
"""

import os

import pytest
import torch
import torch.distributed as dist
from tests.gpu.support.scenario_kit import one_process_group


if not dist.is_available() or not dist.is_nccl_available():
    pytest.skip("needs NCCL", allow_module_level=True)

STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def group():
    with one_process_group():
        yield


def model():
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 8)).cuda()


def train(net, opt, steps=STEPS, scaler=None, autocast=False):
    x = torch.randn(64, 256, device="cuda")
    y = torch.randn(64, 8, device="cuda")
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.item()


def ddp_training():
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = DDP(model(), device_ids=[0], bucket_cap_mb=0.25)  # several gradient buckets
    train(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    torch.cuda.synchronize()


def fsdp1_training():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    net = FSDP(model(), device_id=0, use_orig_params=True,
               auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
    train(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    torch.cuda.synchronize()


def fsdp2_training():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no fully_shard")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (1,))
    net = model()
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(net, mesh=mesh)
    train(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    torch.cuda.synchronize()


def tensor_parallel_training():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda", (1,))
    net = model()
    net = parallelize_module(net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    train(net, torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False))  # DTensor and plain parameters mixed
    torch.cuda.synchronize()


def checkpointed_training():
    from torch.utils.checkpoint import checkpoint

    net = model()

    class Checkpointed(torch.nn.Module):
        def forward(self, x):
            h = checkpoint(net[:4], x, use_reentrant=False)
            return net[4:](h)

    train(Checkpointed(), torch.optim.SGD(net.parameters(), lr=1e-2))
    torch.cuda.synchronize()


def amp_training():
    net = model()
    train(net, torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True), scaler=torch.amp.GradScaler("cuda"),
          autocast=True)
    torch.cuda.synchronize()


SCENARIOS = [ddp_training, fsdp1_training, fsdp2_training, tensor_parallel_training, checkpointed_training,
             amp_training]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_library_training_is_clean(san, scenario):
    session, got = san(scenario)
    assert got == []
    assert session.analyzer.counts["ops"] > 50  # the steps were traced, backward ops included


TORCHRUN_PROGRAM = '''
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
net = DDP(torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4)).cuda(),
          device_ids=[rank])
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x, y = torch.randn(32, 128, device="cuda"), torch.randn(32, 4, device="cuda")
for _ in range(3):
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    opt.zero_grad()
print("loss", torch.nn.functional.mse_loss(net(x), y).item())
dist.destroy_process_group()
'''


@pytest.mark.parametrize("nproc", [1, 2])
def test_wrap_torchrun_ddp_is_clean(tmp_path, nproc):
    """``streamsan wrap -- torchrun ...``: each worker process is traced (from interpreter start), their reports
    merged, and DDP training comes out clean (two workers need two GPUs)."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    import json
    import subprocess
    import sys

    prog = tmp_path / "train.py"
    prog.write_text(TORCHRUN_PROGRAM)
    report = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    r = subprocess.run([sys.executable, "-m", "streamsan", "wrap", "--report", str(report), "--", sys.executable,
                        "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(prog)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "loss" in r.stdout
    rep = json.loads(report.read_text())
    assert rep["races"] == []
    assert rep["complete"] is True
    # the workers' ops, not only the launcher's
    assert rep["summary"]["ops"] > 50 * nproc, (rep["summary"], rep["processes"], r.stderr[-3000:])
