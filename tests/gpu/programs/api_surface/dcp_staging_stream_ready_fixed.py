# Source: pytorch/pytorch torch/distributed/checkpoint/staging.py -- DefaultStager.__init__/_stage (staging stream is a
#   device-generic torch.Stream() created on the main thread; non-blocking D2H copies into cached pinned buffers by
#   StateDictStager, then `self._staging_stream.synchronize()`).  The later version
#   (torch/distributed/checkpoint/_experimental/staging.py DefaultStager.stage/_stage) added
#   `current_stream_ready = torch.Event(enable_timing=True); current_stream_ready.record()` on the trainer's stream and
#   `current_stream_ready.wait()` inside the staging-stream context ("If staging runs on a separate stream, we need to
#   have that stream wait for all operations on the current stream (e.g. optimiser step) to finish").
# Bug: _stage enters `with self._staging_stream:` and enqueues the D2H copies of model.state_dict() right away.  The
#   staging stream never waits for the default stream, so the copies (staging stream, read every parameter) race with
#   the optimizer step still queued on the default stream (writes every parameter): device-device race on the
#   parameters; the checkpoint holds pre-step weights.  The timing events are both recorded on the staging stream, so
#   they order nothing.
# Fix: record a torch.Event on the current (default) stream in stage() and make the staging stream wait on it
#   (Event.wait() inside the `with torch.Stream` context) before the copies; the staging time is measured from that
#   event with Event.elapsed_time.
import torch
import torch.nn as nn
import torch.nn.functional as F

BACKWARD_TAIL_CYCLES = 40_000_000  # grad clipping / comm tail still running on the compute stream


class StateDictStager:
    """Reduced torch/distributed/checkpoint/_state_dict_stager.py: pinned CPU copies, cached per key."""

    def __init__(self, pin_memory=True):
        self.pin_memory = pin_memory
        self._cached_storage = {}

    def stage(self, state_dict, non_blocking=True):
        staged = {}
        for key, tensor in state_dict.items():
            buf = self._cached_storage.get(key)
            if buf is None:
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin_memory)
                self._cached_storage[key] = buf
            buf.copy_(tensor, non_blocking=non_blocking)
            staged[key] = buf
        return staged


class DefaultStager:
    def __init__(self):
        self._state_dict_stager = StateDictStager(pin_memory=True)
        self._accelerator_available = torch.accelerator.is_available()
        # stream created on the main thread after the default stream has been used
        self._staging_stream = torch.Stream() if self._accelerator_available else None
        self.last_staging_ms = None

    def stage(self, state_dict):
        # If staging runs on a separate stream, we need to have that stream wait for all operations on the current
        # stream (e.g. optimiser step) to finish.  This event lets us know when we are ready.
        current_stream_ready = torch.Event(enable_timing=True)
        current_stream_ready.record()
        return self._stage(state_dict, current_stream_ready)

    def _stage(self, state_dict, current_stream_ready):
        with self._staging_stream:
            # Block GPU until the main stream is done with all operations. This does NOT block CPU.
            current_stream_ready.wait()
            state_dict = self._state_dict_stager.stage(state_dict, non_blocking=True)
            staging_stream_end = torch.Event(enable_timing=True)
            staging_stream_end.record()
        # Block CPU thread until all staging work has finished.
        staging_stream_end.synchronize()
        self.last_staging_ms = current_stream_ready.elapsed_time(staging_stream_end)
        return state_dict


def main():
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    stager = DefaultStager()
    data = [(torch.randn(256, 512, device=device), torch.randn(256, 512, device=device)) for _ in range(6)]

    all_match = True
    for step, (x, y) in enumerate(data):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.cuda._sleep(BACKWARD_TAIL_CYCLES)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if (step + 1) % 2 == 0:  # checkpoint every 2 steps
            staged = stager.stage(model.state_dict())
            torch.accelerator.synchronize()
            for key, live in model.state_dict().items():
                same = torch.equal(staged[key], live.detach().cpu())
                all_match &= same
            print(f"step {step}: staged in {stager.last_staging_ms:.2f} ms, checkpoint==weights: {all_match}")

    print(f"match={all_match}")


if __name__ == "__main__":
    main()
