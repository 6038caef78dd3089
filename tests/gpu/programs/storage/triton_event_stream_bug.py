# Source: csarofeen/pytorch PR #2521 "Adding current stream to evt record which
#   is reqd." (events recorded with Event.record() land on the *current*
#   stream, not on the stream the kernels were launched on), combined with
#   triton-lang/triton python/triton/runtime/jit.py: a @triton.jit launch is
#   enqueued on torch.cuda.current_stream() (driver.active.get_current_stream).
#   The reused output buffer mirrors Megatron's GlobalMemoryBuffer-style
#   persistent torch.empty_like workspaces.
# Pattern: a Triton pre-processing kernel runs on a side stream and writes a
# persistent torch.empty_like output buffer; a "ready" event is meant to let
# the default stream consume the buffer, but it is recorded after leaving the
# side-stream context, i.e. on the default stream itself.
import torch
import triton
import triton.language as tl

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
N = 1 << 22
STEPS = 6
BLOCK = 1024


@triton.jit
def scale_shift_kernel(x_ptr, out_ptr, n_elements, scale, shift, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * scale + shift, mask=mask)


class SideStreamPreprocessor:
    def __init__(self, like):
        self.stream = torch.cuda.Stream()
        self.out = torch.empty_like(like)      # reused output workspace (allocated on default)
        self.ready = torch.cuda.Event()

    def launch(self, x, scale, shift):
        # inputs produced on the default stream, and the previous consumer of
        # self.out (also on the default stream) must finish before we overwrite it
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP_CYCLES)    # side stream busy with earlier work
            grid = (triton.cdiv(x.numel(), BLOCK),)
            scale_shift_kernel[grid](x, self.out, x.numel(), scale, shift, BLOCK_SIZE=BLOCK)
        self.ready.record()
        return self.out


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    inputs = [torch.randn(N, device=dev) for _ in range(STEPS)]
    params = [(0.5 + 0.1 * i, 1.0 + i) for i in range(STEPS)]

    # reference: same Triton kernel, default stream only (also JIT-compiles it up front)
    reference = 0.0
    for x, (s, b) in zip(inputs, params):
        ref_out = torch.empty_like(x)
        scale_shift_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, ref_out, x.numel(), s, b,
                                                              BLOCK_SIZE=BLOCK)
        reference += ref_out.double().sum().item()
    torch.cuda.synchronize()

    pre = SideStreamPreprocessor(inputs[0])
    sums = []
    for x, (s, b) in zip(inputs, params):
        out = pre.launch(x, s, b)
        torch.cuda.current_stream().wait_event(pre.ready)
        sums.append(out.double().sum())        # consumer on the default stream
    checksum = torch.stack(sums).sum().item()
    torch.cuda.synchronize()
    match = abs(checksum - reference) <= 1e-6 * max(1.0, abs(reference))
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
