# Source: pfnet-research/torch-dftd torch_dftd/functions/triplets_kernel.py (CuPy ElementwiseKernels inside a
#         PyTorch model, ppe.cuda.use_torch_mempool_in_cupy()) and pfnet/pytorch-pfn-extras
#         pytorch_pfn_extras/cuda/_allocator.py (_torch_alloc / _torch_free / ppe.cuda.stream).
# Bug: CuPy allocations are routed into PyTorch's caching allocator by a hand-rolled hook like ppe's _torch_alloc
#      but without its "PyTorch and CuPy current streams must be the same" check: blocks are allocated on
#      torch's *current* stream (the default stream) while the CuPy kernels run on a separate non-blocking CuPy
#      stream. The temporary `counts` array is written and (after a long kernel) read on the CuPy stream, but
#      when the Python function returns it is handed back with caching_allocator_delete() and becomes
#      immediately reusable by the default stream; the next torch allocation there (e2_atom) gets the block
#      and zero-fills/accumulates into it while the CuPy stream has not read `counts` yet.
# Fix: run the CuPy work under a ppe.cuda.stream-style context (torch current stream == CuPy current stream ==
#      a torch side stream) and let _torch_alloc allocate on that stream (and refuse mismatched streams), so
#      freed CuPy temporaries are only reused by later work on the same stream.
import cupy
import torch

SLEEP_CYCLES = 30_000_000  # ~15 ms: stands in for the heavy triplet-enumeration kernel

_count_neighbors = cupy.ElementwiseKernel(
    "int64 dst", "raw float64 counts", "atomicAdd(&counts[dst], 1.0)", "dftd_count_neighbors")
_coord_weight = cupy.ElementwiseKernel(
    "float64 c", "float32 w", "w = 0.5f * (float)sqrt(c)", "dftd_coord_weight")


def _torch_alloc(size, device_id):
    # allocate on PyTorch's current stream; CuPy may be running on a different one
    return torch.cuda.caching_allocator_alloc(size, device_id, torch.cuda.current_stream().cuda_stream)


def _torch_free(mem_ptr, device_id):
    torch.cuda.caching_allocator_delete(mem_ptr)


def use_torch_mempool_in_cupy():
    global _allocator
    _allocator = cupy.cuda.memory.PythonFunctionAllocator(_torch_alloc, _torch_free)
    cupy.cuda.set_allocator(_allocator.malloc)


def _heavy_kernel_stand_in():
    with torch.cuda.stream(torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr)):
        torch.cuda._sleep(SLEEP_CYCLES)


def calc_coordination_weights(edge_dst_t, n_atoms):
    """Three-body coordination weights, computed with CuPy kernels on the current CuPy stream."""
    edge_dst = cupy.from_dlpack(edge_dst_t)
    counts = cupy.zeros(n_atoms, dtype=cupy.float64)  # temporary, lives only in this function
    _count_neighbors(edge_dst, counts)
    _heavy_kernel_stand_in()
    w3 = cupy.empty(n_atoms, dtype=cupy.float32)
    _coord_weight(counts, w3)
    return w3


use_torch_mempool_in_cupy()
triplet_stream = cupy.cuda.Stream(non_blocking=True)
triplet_stream_t = torch.cuda.ExternalStream(triplet_stream.ptr)


def triplet_stream_ctx():
    return triplet_stream


def main():
    torch.manual_seed(0)
    n_atoms, n_edges, steps, dt = 1 << 16, 1 << 18, 3, 1e-3
    pos = torch.rand(n_atoms, 3, device="cuda") * 40.0
    vel = torch.randn(n_atoms, 3, device="cuda")
    edge_src = torch.randint(0, n_atoms, (n_edges,), device="cuda")
    edge_dst = torch.randint(0, n_atoms, (n_edges,), device="cuda")
    torch.cuda.synchronize()

    energies, positions = [], []
    for step in range(steps):  # MD loop: two-body term in torch, three-body weights in CuPy, overlapped
        pos.add_(vel * dt)
        positions.append(pos.clone())
        triplet_stream_t.wait_stream(torch.cuda.current_stream())
        with triplet_stream_ctx():
            w3 = calc_coordination_weights(edge_dst, n_atoms)
        e2_atom = torch.zeros(n_atoms, dtype=torch.float64, device="cuda")
        d = (pos[edge_src] - pos[edge_dst]).norm(dim=-1).double()
        e2_atom.index_add_(0, edge_dst, -1.0 / (d**6 + 1.0))
        torch.cuda.current_stream().wait_stream(triplet_stream_t)
        w3_t = torch.from_dlpack(w3)
        energies.append((e2_atom * (1.0 + w3_t)).sum())
    torch.cuda.synchronize()

    counts = torch.bincount(edge_dst, minlength=n_atoms).double()
    w3_ref = (0.5 * counts.sqrt()).float()
    ref = []
    for p in positions:
        d = (p[edge_src] - p[edge_dst]).norm(dim=-1).double()
        e2 = torch.zeros(n_atoms, dtype=torch.float64, device="cuda").index_add_(0, edge_dst, -1.0 / (d**6 + 1.0))
        ref.append((e2 * (1.0 + w3_ref)).sum())
    match = all(torch.allclose(e, r, rtol=1e-6) for e, r in zip(energies, ref))
    print(f"match={match}")


if __name__ == "__main__":
    main()
