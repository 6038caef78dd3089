# Source: mit-han-lab/smoothquant, smoothquant/calibration.py get_act_scales(): forward hooks
#   (stat_input_hook -> stat_tensor) on every nn.Linear of an OPT model collect the per-channel input abs-max,
#   `torch.max(tensor, dim=0)[0].float().cpu()`, i.e. one blocking D2H copy per hook call. This variant keeps the
#   hooks sync-free: the hook hands `comming_max` to a background thread that owns its own CUDA stream, keeps
#   the running max on the GPU and, on close(), copies act_scales into pinned host tensors with non_blocking
#   copies (random-init tiny OPTForCausalLM from transformers, no download).
# Bug: the worker thread enqueues the device->pinned-host copies of act_scales on its stream and returns; the
#   main thread join()s the thread and reads the pinned tensors (`.numpy()`) at once. Joining a thread orders
#   the host threads, not the GPU: the worker stream is still busy (its per-item work) and the copies have not
#   run. Race: worker-stream D2H write of the pinned act_scales[name] tensors vs the main thread's host read.
# Fix: the worker calls self.stream.synchronize() after enqueuing the copies, before the thread ends.
import functools
import queue
import threading

import numpy as np
import torch
import torch.nn as nn
from transformers import OPTConfig, OPTForCausalLM

DEV = "cuda:0"
N_SAMPLES = 4
SEQ_LEN = 128
HIST_CYCLES = 2_000_000  # per submitted tensor: stands in for a histogram/percentile update


class ActScaleCollector:
    def __init__(self):
        self.stream = torch.cuda.Stream()
        self.queue = queue.Queue()
        self.act_scales = {}
        self._dev_scales = {}
        self.thread = threading.Thread(target=self._worker, daemon=True)
        self.thread.start()

    def submit(self, name, comming_max):
        ready = torch.cuda.Event()
        ready.record()  # comming_max is produced on the caller's (default) stream
        comming_max.record_stream(self.stream)
        self.queue.put((name, comming_max, ready))

    def _worker(self):
        while True:
            item = self.queue.get()
            if item is None:
                break
            name, comming_max, ready = item
            self.stream.wait_event(ready)
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(HIST_CYCLES)
                if name in self._dev_scales:
                    self._dev_scales[name] = torch.max(self._dev_scales[name], comming_max)
                else:
                    self._dev_scales[name] = comming_max.clone()
        with torch.cuda.stream(self.stream):
            for name, t in self._dev_scales.items():
                host = torch.zeros(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                self.act_scales[name] = host

    def close(self):
        self.queue.put(None)
        self.thread.join()
        return self.act_scales


def get_act_scales_async(model, input_ids):
    collector = ActScaleCollector()

    def stat_tensor(name, tensor):
        hidden_dim = tensor.shape[-1]
        tensor = tensor.reshape(-1, hidden_dim).abs().detach()
        comming_max = torch.max(tensor, dim=0)[0].float()
        collector.submit(name, comming_max)

    def stat_input_hook(m, x, y, name):
        if isinstance(x, tuple):
            x = x[0]
        stat_tensor(name, x)

    hooks = [m.register_forward_hook(functools.partial(stat_input_hook, name=name))
             for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for i in range(N_SAMPLES):
        model(input_ids[i:i + 1])
    for h in hooks:
        h.remove()
    return collector.close()


def get_act_scales_reference(model, input_ids):
    act_scales = {}

    def stat_input_hook(m, x, y, name):
        x = x[0] if isinstance(x, tuple) else x
        comming_max = torch.max(x.reshape(-1, x.shape[-1]).abs().detach(), dim=0)[0].float().cpu()
        act_scales[name] = torch.max(act_scales[name], comming_max) if name in act_scales else comming_max

    hooks = [m.register_forward_hook(functools.partial(stat_input_hook, name=name))
             for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for i in range(N_SAMPLES):
        model(input_ids[i:i + 1])
    for h in hooks:
        h.remove()
    return act_scales


@torch.no_grad()
def main():
    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=1000, hidden_size=256, ffn_dim=1024, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=512, word_embed_proj_dim=256)
    model = OPTForCausalLM(cfg).to(DEV).eval()
    input_ids = torch.randint(3, cfg.vocab_size, (N_SAMPLES, SEQ_LEN), device=DEV)

    act_scales = get_act_scales_async(model, input_ids)
    got = {name: t.numpy().copy() for name, t in act_scales.items()}  # e.g. saved with torch.save / json

    torch.cuda.synchronize()
    ref = get_act_scales_reference(model, input_ids)
    ok = set(got) == set(ref) and all(np.allclose(got[n], ref[n].numpy(), rtol=1e-5, atol=0) for n in ref)
    name = next(n for n in sorted(ref) if n.endswith("fc1"))
    print(f"{len(got)} linears; {name}: got max {got[name].max():.4f} ref max {ref[name].max().item():.4f}")
    print(f"match={ok}")


if __name__ == "__main__":
    main()
