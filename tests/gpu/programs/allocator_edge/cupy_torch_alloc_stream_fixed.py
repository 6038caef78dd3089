# Source: pytorch-pfn-extras, pytorch_pfn_extras/cuda/_allocator.py: use_torch_mempool_in_cupy() installs
#   cupy.cuda.memory.PythonFunctionAllocator(_torch_alloc, _torch_free), where _torch_alloc calls
#   torch.cuda.caching_allocator_alloc(size, device_id, stream_ptr) and _torch_free calls
#   torch.cuda.caching_allocator_delete(ptr); PPE raises unless torch's and CuPy's current streams are the same
#   (ppe.cuda.stream() switches both). FlagGems' Triton allocator hook has the same shape and passes no stream:
#   torch.cuda.caching_allocator_alloc(size).
# Bug: this hook drops PPE's stream check and calls caching_allocator_alloc(size, device) with no stream, so every
#   CuPy allocation is tied to torch's current stream (the default stream) while the CuPy preprocessing kernels run
#   on CuPy's stream (an ExternalStream over a non-blocking torch side stream). The float32 temporary `x` of
#   preprocess() is written/read on the CuPy stream and freed (caching_allocator_delete) as soon as preprocess()
#   returns on the host; the allocator hands its block at once to the text tower's matmul output on the default
#   stream, which writes and later reads it while the CuPy stream's accesses to `x` are still pending: nothing
#   orders the CuPy stream's work before the new allocation's use on the default stream.
# Fix: the hook allocates on the stream the memory is used on, caching_allocator_alloc(size, device,
#   cupy.cuda.get_current_stream().ptr), so CuPy's temporaries are only recycled by later CuPy-stream allocations.
import torch
import cupy as cp

STEPS, B, H, W = 5, 8, 128, 128
T, D, E = 128, 384, 256            # B*T*D fp32 == B*H*W*3 fp32 == 1.5 MiB
DECODE_DELAY = 20_000_000          # cycles on the CuPy stream before preprocessing (decode stand-in)
TEXT_DELAY = 50_000_000            # cycles of deeper text-tower layers on the default stream


def _torch_alloc(size, device_id):
    # Tie the block to the stream CuPy will use it on, not to torch's current stream.
    return torch.cuda.caching_allocator_alloc(size, device_id, cp.cuda.get_current_stream().ptr)


def _torch_free(mem_ptr, device_id):
    torch.cuda.caching_allocator_delete(mem_ptr)


_allocator = None


def use_torch_mempool_in_cupy():
    global _allocator
    _allocator = cp.cuda.memory.PythonFunctionAllocator(_torch_alloc, _torch_free)
    cp.cuda.set_allocator(_allocator.malloc)


def preprocess(raw_u8, mean, inv_std):
    """CuPy image pipeline: uint8 NHWC -> normalized fp16 NCHW, on CuPy's current stream."""
    x = raw_u8.astype(cp.float32)
    x -= mean
    x *= inv_std
    return cp.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=cp.float16)


def text_tower(tok_emb, w_t):
    h = tok_emb @ w_t
    h.tanh_()
    torch.cuda._sleep(TEXT_DELAY)                      # deeper text layers
    return h.square_().mean(dim=(1, 2))


def image_tower(pix, w_i):
    return pix.mean(dim=(2, 3), dtype=torch.float32) @ w_i


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    use_torch_mempool_in_cupy()
    raw = torch.randint(0, 256, (STEPS, B, H, W, 3), dtype=torch.uint8, device=dev)
    tok_emb = torch.randn(STEPS, B, T, D, device=dev)
    w_t = torch.randn(D, D, device=dev) / D ** 0.5
    w_i = torch.randn(3, E, device=dev)
    raw_cp = cp.from_dlpack(raw)
    mean = cp.asarray([123.7, 116.3, 103.5], dtype=cp.float32)
    inv_std = cp.asarray([1 / 58.4, 1 / 57.1, 1 / 57.4], dtype=cp.float32)
    torch.cuda.synchronize()                           # inputs and constants are ready
    side = torch.cuda.Stream()
    cp_stream = cp.cuda.ExternalStream(side.cuda_stream)
    with cp_stream:                                    # warm-up: compile CuPy kernels, init cuBLAS
        warm = preprocess(raw_cp[0], mean, inv_std)
    cp_stream.synchronize()
    del warm
    text_tower(tok_emb[0], w_t)
    torch.cuda.synchronize()

    results = []
    for i in range(STEPS):
        side.wait_stream(torch.cuda.current_stream())  # previous batch consumed before we refill
        with torch.cuda.stream(side):
            torch.cuda._sleep(DECODE_DELAY)
        with cp_stream:
            pix_cp = preprocess(raw_cp[i], mean, inv_std)
        txt = text_tower(tok_emb[i], w_t)
        with cp_stream:
            pix = torch.from_dlpack(pix_cp)            # default stream waits on cp_stream here
        del pix_cp
        img = image_tower(pix, w_i)
        del pix
        results.append((txt, img))
    torch.cuda.synchronize()

    mean_t = torch.as_tensor(mean.get(), device=dev)
    inv_std_t = torch.as_tensor(inv_std.get(), device=dev)
    ok = True
    for i, (txt, img) in enumerate(results):
        x = (raw[i].float() - mean_t) * inv_std_t
        pix_ref = x.permute(0, 3, 1, 2).contiguous().half()
        h = torch.tanh(tok_emb[i] @ w_t)
        ok = ok and torch.allclose(txt, h.square().mean(dim=(1, 2)), rtol=1e-3, atol=1e-4)
        ok = ok and torch.allclose(img, image_tower(pix_ref, w_i), rtol=1e-3, atol=1e-3)
    print(f"match={ok}")


if __name__ == "__main__":
    main()
