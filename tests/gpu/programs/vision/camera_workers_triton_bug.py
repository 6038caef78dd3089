# Case: multi-camera preprocessing with one Python worker thread per camera. Each worker owns a
# CuPy stream (wrapped for PyTorch with torch.cuda.ExternalStream), converts its camera's BGR HWC
# uint8 frame with CuPy and normalises it with a Triton kernel straight into its own slice of a
# shared batch tensor; the main thread joins the workers and runs the backbone on the default stream.
# Source: plausible pattern. Triton launches from side threads: triton-lang/triton #3729; Triton
#   kernels following the active user stream: pytorch/pytorch PR #178547; ExternalStream wrapping a
#   foreign (CuPy) stream: torch.cuda.ExternalStream docs.
# BUG: Thread.join() only orders the host; the workers' streams are never synchronised or waited on,
#   so the backbone (default stream) reads `batch` while the Triton kernels may still be writing it.
#   (Each worker writes a disjoint slice batch[cam], and the CuPy -> Triton hand-off is on one stream.)
import threading
import cupy as cp
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def normalize_kernel(src_ptr, dst_ptr, mean_ptr, std_ptr, HW, BLOCK: tl.constexpr):
    c = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HW
    x = tl.load(src_ptr + c * HW + offs, mask=mask).to(tl.float32)
    m = tl.load(mean_ptr + c)
    s = tl.load(std_ptr + c)
    tl.store(dst_ptr + c * HW + offs, (x / 255.0 - m) / s, mask=mask)


class CameraWorker:
    def __init__(self, cam_id, mean, std):
        self.cam_id, self.mean, self.std = cam_id, mean, std
        self.cp_stream = cp.cuda.Stream(non_blocking=True)
        self.stream = torch.cuda.ExternalStream(self.cp_stream.ptr)

    def process(self, frame, out):
        # frame (H, W, 3) uint8 and out (3, H, W) float32 are torch tensors made on the default stream
        self.stream.wait_stream(torch.cuda.default_stream())
        with self.cp_stream, torch.cuda.stream(self.stream):  # one stream, seen by CuPy and torch
            bgr = cp.asarray(frame)
            chw = cp.ascontiguousarray(bgr[:, :, ::-1].transpose(2, 0, 1))  # BGR HWC -> RGB CHW
            src = torch.as_tensor(chw, device="cuda")  # zero-copy view of the CuPy buffer
            hw = out.shape[1] * out.shape[2]
            grid = (triton.cdiv(hw, 1024), 3)
            normalize_kernel[grid](src, out, self.mean, self.std, hw, BLOCK=1024)

    def run(self, frame, out):
        torch.cuda.set_device(0)
        self.process(frame, out)


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 32, 5, 4, 2), nn.ReLU(), nn.Conv2d(32, 64, 3, 2, 1), nn.ReLU(),
                                 nn.Conv2d(64, 128, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(128, 64))

    def forward(self, x):
        return self.net(x)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    n_cam, H, W = 4, 480, 640
    mean = torch.tensor([0.485, 0.456, 0.406], device="cuda")
    std = torch.tensor([0.229, 0.224, 0.225], device="cuda")
    backbone = Backbone().cuda().eval()
    workers = [CameraWorker(i, mean, std) for i in range(n_cam)]

    # compile the CuPy and Triton kernels once on the main thread, then drain the device
    warm_frame, scratch = torch.zeros(H, W, 3, dtype=torch.uint8, device="cuda"), torch.empty(3, H, W, device="cuda")
    workers[0].process(warm_frame, scratch)
    torch.cuda.synchronize()
    del warm_frame, scratch

    g = torch.Generator(device="cuda").manual_seed(0)
    frames = torch.randint(0, 256, (n_cam, H, W, 3), dtype=torch.uint8, device="cuda", generator=g)
    batch = torch.empty(n_cam, 3, H, W, device="cuda")
    threads = [threading.Thread(target=w.run, args=(frames[i], batch[i])) for i, w in enumerate(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    feats = backbone(batch)  # default stream
    sim = torch.nn.functional.normalize(feats, dim=1) @ torch.nn.functional.normalize(feats, dim=1).T
    print("cross-camera similarity", sim.sum().item())
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
