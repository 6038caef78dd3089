"""Code the GPU tests share (they import it as ``tests.gpu.support``); it needs torch, and CUDA to run."""
