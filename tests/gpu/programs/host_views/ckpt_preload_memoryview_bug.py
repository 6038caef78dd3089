# Source: megatron/core/dist_checkpointing/strategies/filesystem_async.py, FileSystemWriterAsync.preload_tensors()
#   (tensor.to("cpu", non_blocking=True) for every item of every write bucket, then `if non_blocking:
#   torch.cuda.synchronize()`) followed by write_preloaded_data(), which serialises the staged CPU tensors
#   (here in the raw-bytes / safetensors-like layout: a JSON header and memoryview(t.numpy()) payloads).
# Bug: preload_tensors() keeps non_blocking=True but loses the torch.cuda.synchronize() (a "the writer runs later
#   anyway" refactor). .to("cpu", non_blocking=True) returns fresh pinned tensors that the D2H copies on the
#   default stream fill only after the training step queued before them finishes; write_preloaded_data() reads the
#   same pinned bytes on the host through memoryview(tensor.numpy()) with no happens-before edge to those copies.
#   The checkpoint file gets whatever the pinned blocks held before.
# Fix: torch.cuda.synchronize() at the end of preload_tensors() when non_blocking (upstream Megatron behaviour).
import hashlib
import io
import json
from pathlib import Path

import torch
import torch.nn as nn

HIDDEN = 512


def build_model(device):
    return nn.Sequential(
        nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN), nn.LayerNorm(HIDDEN)
    ).to(device)


def train_step(model, opt, device):
    x = torch.randn(64, HIDDEN, device=device)
    torch.cuda._sleep(40_000_000)  # the rest of a large training iteration still running on the GPU
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def prepare_write_buckets(model, opt):
    tensor_data = [(name, p.detach()) for name, p in model.state_dict().items()]
    for i, st in enumerate(opt.state.values()):
        tensor_data.append(("optimizer.state.%d.exp_avg" % i, st["exp_avg"]))
        tensor_data.append(("optimizer.state.%d.exp_avg_sq" % i, st["exp_avg_sq"]))
    bytes_data = [("common.json", io.BytesIO(json.dumps({"iteration": 3}).encode()))]
    return [(Path("__0_0.distcp"), "0_0", (bytes_data, tensor_data))]


class FileSystemWriterAsync:
    @staticmethod
    def preload_tensors(write_buckets, non_blocking=True):
        result = []
        for bucket in write_buckets:
            file_name, storage_key, (bytes_data, tensor_data) = bucket
            tensor_data = [(item, tensor.to("cpu", non_blocking=non_blocking)) for item, tensor in tensor_data]
            result.append((file_name, storage_key, (bytes_data, tensor_data)))
        return result

    @staticmethod
    def write_preloaded_data(write_bucket, stream):
        file_name, storage_key, (bytes_data, tensor_data) = write_bucket
        header, offset = {}, 0
        for item, t in tensor_data:
            header[item] = {"dtype": str(t.dtype), "shape": list(t.shape), "offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        for item, data in bytes_data:
            header[item] = {"bytes": data.getvalue().decode()}
        blob = json.dumps(header).encode()
        stream.write(len(blob).to_bytes(8, "little"))
        stream.write(blob)
        for item, t in tensor_data:
            stream.write(memoryview(t.numpy()).cast("B"))  # host reads the staged pinned tensor
        return {"file": str(file_name), "storage_key": storage_key, "bytes": stream.tell()}


def main():
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    model = build_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for it in range(2):
        train_step(model, opt, device)

    train_step(model, opt, device)  # iteration 3: the GPU is still busy with it when the save starts
    write_buckets = prepare_write_buckets(model, opt)
    snapshot = {item: t.clone() for item, t in write_buckets[0][2][1]}  # stream-ordered reference copy
    preloaded = FileSystemWriterAsync.preload_tensors(write_buckets, non_blocking=True)
    f = io.BytesIO()
    meta = FileSystemWriterAsync.write_preloaded_data(preloaded[0], f)
    del preloaded
    train_step(model, opt, device)  # training goes on while the checkpoint is "on disk"

    torch.cuda.synchronize()
    raw = f.getvalue()
    hlen = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + hlen])
    payload = raw[8 + hlen:]
    match = True
    for item, ref in snapshot.items():
        lo, hi = header[item]["offsets"]
        got = torch.frombuffer(bytearray(payload[lo:hi]), dtype=ref.dtype).view(ref.shape)
        match &= bool(torch.equal(got, ref.cpu()))
    print(meta, "sha256=%s" % hashlib.sha256(raw).hexdigest()[:16])
    print("match=%s" % match)


if __name__ == "__main__":
    main()
