"""Everyday GPU programs built on real libraries, which must come out clean under streamsan: the ImageNet-style
training loop (DataLoader workers, a pin-memory thread, non-blocking copies), a Lightning fit, transformers'
generate with a static cache, and accelerate's CPU offload. Each runs a few steps; any finding is a false report
and any exception a bug of streamsan's (the programs run untraced first, so a broken program fails there)."""

import pytest
import torch
from tests.gpu.support.scenario_kit import findings_of, untraced_then_traced



def imagenet_style_training():
    tv = pytest.importorskip("torchvision")
    data = tv.datasets.FakeData(size=48, image_size=(3, 64, 64), num_classes=10,
                                transform=tv.transforms.ToTensor())
    loader = torch.utils.data.DataLoader(data, batch_size=16, num_workers=2, pin_memory=True)
    model = tv.models.resnet18(num_classes=10).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for images, target in loader:
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(images), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return round(loss.item(), 1) > -1


def lightning_fit():
    pl = pytest.importorskip("pytorch_lightning")

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g))
    trainer = pl.Trainer(max_steps=4, accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(ds, batch_size=16, pin_memory=True))
    torch.cuda.synchronize()
    return trainer.global_step


def generate_static_cache():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=1000)
    model = tf.Qwen3ForCausalLM(cfg).cuda().eval()
    ids = torch.randint(0, 1000, (1, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    out = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    torch.cuda.synchronize()
    return out.tolist()


def accelerate_cpu_offload():
    acc = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    acc.cpu_offload(model, execution_device=torch.device("cuda", 0))
    x = torch.randn(4, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        y = model(x)
    torch.cuda.synchronize()
    return [round(v, 4) for v in y.flatten().tolist()]


PROGRAMS = [imagenet_style_training, lightning_fit, generate_static_cache, accelerate_cpu_offload]


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda f: f.__name__)
def test_real_program_is_clean(program):
    expected, got, session = untraced_then_traced(program)
    assert got == expected
    assert findings_of(session) == []
    assert session.analyzer.counts["ops"] > 10  # the accelerate case is the smallest: 13 ops on an H200
