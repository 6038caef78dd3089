"""The torch tracer (:class:`.tracer.TorchTracer`) and its parts: the op rules, the dispatch mode and its Python
path, the C core's contract, the GPU trace callbacks, placement, allocators, host memory, CUDA graphs, the autograd
engine, and the patched PyTorch surfaces (:mod:`.patches`).
"""
