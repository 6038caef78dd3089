"""Two-producer input pipeline: an image worker thread and a label worker
thread, each with its own copy stream, fill the two halves of a Batch that the
training loop consumes on the default stream.

Modeled on: vllm-project/vllm issue #53960 (PleOffloadConnector allocated ONE
`_input_ready_event` for the whole connector; a second in-flight request
re-recorded the same event, so the consumer waited on the wrong work) and the
ready-event pattern of DataLoader prefetchers (NVIDIA/apex
examples/imagenet/main_amp.py data_prefetcher).  Self-contained re-creation.

BUG: Batch carries ONE `ready` event that both producers record on their own
streams.  cudaStreamWaitEvent only waits for the most recent record, so the
trainer is ordered after whichever producer recorded last, never the other.
"""
import queue
import threading

import torch
import torch.nn.functional as F

DEV = torch.device("cuda:0")
N_BATCHES = 6
B, C, H, W = 32, 3, 64, 64
N_CLASSES = 10


class Batch:
    def __init__(self, idx, images_u8, labels):
        self.idx = idx
        self.images_cpu = images_u8  # pinned uint8 [B, C, H, W]
        self.labels_cpu = labels  # pinned int64 [B]
        self.images = None
        self.onehot = None
        self.ready = torch.cuda.Event()  # shared by both producers
        self.ready.record()  # create the event up front (on the main stream)


class ImageWorker(threading.Thread):
    def __init__(self, inbox, outbox, mean, std):
        super().__init__(name="image-worker", daemon=True)
        self.inbox, self.outbox, self.mean, self.std = inbox, outbox, mean, std

    def run(self):
        stream = torch.cuda.Stream(device=DEV)
        with torch.cuda.stream(stream):
            while (batch := self.inbox.get()) is not None:
                x = batch.images_cpu.to(DEV, non_blocking=True)
                x = (x.float().div_(255.0) - self.mean) / self.std
                batch.images = x
                batch.ready.record(stream)
                self.outbox.put((batch, "images"))


class LabelWorker(threading.Thread):
    def __init__(self, inbox, outbox):
        super().__init__(name="label-worker", daemon=True)
        self.inbox, self.outbox = inbox, outbox

    def run(self):
        stream = torch.cuda.Stream(device=DEV)
        with torch.cuda.stream(stream):
            while (batch := self.inbox.get()) is not None:
                y = batch.labels_cpu.to(DEV, non_blocking=True)
                batch.onehot = F.one_hot(y, N_CLASSES).float().mul_(0.9).add_(0.01)
                batch.ready.record(stream)
                self.outbox.put((batch, "labels"))


def make_dataset():
    g = torch.Generator().manual_seed(0)
    data = []
    for i in range(N_BATCHES):
        imgs = torch.randint(0, 256, (B, C, H, W), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, N_CLASSES, (B,), generator=g)
        data.append(Batch(i, imgs.pin_memory(), labels.pin_memory()))
    return data


def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(C * H * W, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, N_CLASSES)).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mean = torch.tensor([0.485, 0.456, 0.406], device=DEV).view(1, C, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=DEV).view(1, C, 1, 1)
    batches = make_dataset()
    torch.cuda.synchronize()

    img_q, lbl_q, done_q = queue.Queue(), queue.Queue(), queue.Queue()
    workers = [ImageWorker(img_q, done_q, mean, std), LabelWorker(lbl_q, done_q)]
    for w in workers:
        w.start()
    for b in batches:
        img_q.put(b)
        lbl_q.put(b)
    img_q.put(None)
    lbl_q.put(None)

    main_stream = torch.cuda.current_stream()
    parts = {}
    loss_sum = torch.zeros((), device=DEV)
    trained = 0
    while trained < N_BATCHES:
        batch, part = done_q.get(timeout=60)
        parts[batch.idx] = parts.get(batch.idx, 0) + 1
        if parts[batch.idx] < 2:
            continue
        main_stream.wait_event(batch.ready)
        batch.images.record_stream(main_stream)
        batch.onehot.record_stream(main_stream)
        logits = model(batch.images)
        loss = torch.sum(-batch.onehot * F.log_softmax(logits, dim=1), dim=1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_sum += loss.detach()
        trained += 1
        del batch, logits, loss
    for w in workers:
        w.join()
    torch.cuda.synchronize()
    print(f"trained {trained} batches, mean loss {loss_sum.item() / trained:.4f}")


if __name__ == "__main__":
    main()
