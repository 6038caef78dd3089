# Source: pytorch/pytorch torch/distributed/checkpoint/staging.py, DefaultStager(StagingOptions(use_async_staging=
#         True, use_non_blocking_copy=True)) (_stage() runs in a ThreadPoolExecutor on _staging_stream and ends with
#         _staging_stream.synchronize()); pytorch/torchtitan torchtitan/components/checkpoint.py,
#         CheckpointManager.maybe_wait_for_staging() called before the next optimizer step.
# Bug: the checkpoint stager copies the model's parameters to pinned CPU buffers with non_blocking copies on
#      its staging stream from a background thread. The training loop goes straight on to optimizer.step(),
#      whose in-place parameter update (default stream) is not ordered after the staging copies that read the
#      same parameters (staging stream): the checkpoint can capture post-step weights.
# Fix: call stager.synchronize_staging() (future.result(); the worker thread has done
#      _staging_stream.synchronize()) before optimizer.step(), as torchtitan's maybe_wait_for_staging() does.
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn

SLEEP_CYCLES = 40_000_000  # ~20 ms: the staging copies queue behind other PCIe traffic


class DefaultStager:
    def __init__(self):
        self._staging_executor = ThreadPoolExecutor(max_workers=1)
        # created on the main thread, after the default stream has been used
        self._staging_stream = torch.cuda.Stream()
        self._cpu_cache = {}
        self._staging_future = None

    def stage(self, state_dict, ready_event):
        self._staging_future = self._staging_executor.submit(self._stage, state_dict, ready_event)
        return self._staging_future

    def _stage(self, state_dict, ready_event):
        with torch.cuda.stream(self._staging_stream):
            self._staging_stream.wait_event(ready_event)  # params written by the last step are visible
            torch.cuda._sleep(SLEEP_CYCLES)
            staged = {}
            for key, tensor in state_dict.items():
                if key not in self._cpu_cache:
                    self._cpu_cache[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                staged[key] = self._cpu_cache[key].copy_(tensor, non_blocking=True)
        # waits for the enqueued copy operations to finish.
        self._staging_stream.synchronize()
        return staged

    def synchronize_staging(self):
        if self._staging_future is not None:
            self._staging_future.result()

    def close(self):
        self._staging_executor.shutdown(wait=True)


class CheckpointManager:
    def __init__(self, model, interval):
        self.model = model
        self.interval = interval
        self.stager = DefaultStager()
        self.staged = None

    def save(self, step):
        if step % self.interval != 0:
            return None
        ready = torch.cuda.Event()
        ready.record()
        state_dict = {k: v.detach() for k, v in self.model.state_dict().items()}
        self.staged = self.stager.stage(state_dict, ready)
        return step

    def maybe_wait_for_staging(self):
        self.stager.synchronize_staging()


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    data = [torch.randn(256, 1024, device="cuda") for _ in range(4)]
    ckpt = CheckpointManager(model, interval=3)
    torch.cuda.synchronize()

    snapshot, saved_step = None, None
    for step in range(1, 5):
        loss = model(data[step - 1]).pow(2).mean()
        loss.backward()
        if ckpt.save(step) is not None:
            saved_step = step
            snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}  # reference, default stream
        ckpt.maybe_wait_for_staging()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    staged = ckpt.staged.result()  # background thread has synchronized its staging stream
    ckpt.stager.close()
    torch.cuda.synchronize()

    match = all(torch.equal(staged[k], snapshot[k].cpu()) for k in snapshot)
    print(f"checkpoint_step={saved_step} match={match}")


if __name__ == "__main__":
    main()
