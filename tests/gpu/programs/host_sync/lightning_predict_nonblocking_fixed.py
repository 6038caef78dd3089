# Source: Lightning-AI/pytorch-lightning issue #11287 "GPU prediction race condition results in
#   BasePredictionWriter observing incorrect (zero) values", fixed by PR #11288 "Avoid non-blocking
#   GPU->CPU copies" (move_data_to_device / TransferableDataType.to in utilities/apply_func.py).
# The predict loop moves every batch's predictions to the CPU with non_blocking=True; a
# BasePredictionWriter(write_interval="epoch") then reads them on the host before the D2H copies ran.
import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms: an "expensive model" per predict step (as in the issue)
DEVICE = torch.device("cuda", 0)
NUM_BATCHES = 6


def move_data_to_device(batch, device):
    """Recursively move a collection of tensors, like Lightning's apply_to_collection helper."""
    device = torch.device(device)
    if isinstance(batch, dict):
        return {k: move_data_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_data_to_device(v, device) for v in batch)
    if isinstance(batch, torch.Tensor):
        # fix (PR #11288): never use non_blocking for a GPU->CPU move; the host reads the result next
        non_blocking = device.type != "cpu"
        return batch.to(device, non_blocking=non_blocking)
    return batch


class PredictionWriter:
    """A trivial BasePredictionWriter with write_interval="epoch": it reduces what it is given."""

    def __init__(self):
        self.written = []

    def on_predict_epoch_end(self, trainer, predictions):
        self.write_on_epoch_end(trainer, predictions)

    def write_on_epoch_end(self, trainer, predictions):
        total = 0.0
        for pred in predictions:
            total += float(pred["logits"].double().sum())
        self.written.append(total)


class Trainer:
    def __init__(self, callbacks):
        self.callbacks = callbacks
        self.gpu_outputs = []  # kept for the reference checksum only

    @torch.no_grad()
    def predict(self, model, dataloader):
        predictions = []
        for batch in dataloader:
            torch.cuda._sleep(SLEEP_CYCLES)
            logits = model(batch["x"])
            out = {"logits": logits}
            self.gpu_outputs.append(out)
            predictions.append(move_data_to_device(out, "cpu"))
        for cb in self.callbacks:
            cb.on_predict_epoch_end(self, predictions)
        return predictions


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 16)).to(DEVICE).eval()
    dataloader = [{"x": torch.randn(2048, 512, device=DEVICE)} for _ in range(NUM_BATCHES)]
    torch.cuda.synchronize()

    writer = PredictionWriter()
    trainer = Trainer(callbacks=[writer])
    predictions = trainer.predict(model, dataloader)  # host copies stay alive until the end

    torch.cuda.synchronize()
    reference = 0.0
    for out in trainer.gpu_outputs:
        reference += out["logits"].double().sum().item()
    checksum = writer.written[0]
    match = abs(checksum - reference) <= 1e-6 * max(1.0, abs(reference))
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match} batches={len(predictions)}")


if __name__ == "__main__":
    main()
