/* A CUDA allocator for torch.cuda.memory.CUDAPluggableAllocator (test_allocator_backends.py): stream-ordered
 * allocations from the device's default memory pool through the CUDA driver (no CUDA headers needed), as RMM's
 * asynchronous resource does. PyTorch's GPU trace hears nothing from such an allocator. */
#include <dlfcn.h>
#include <stddef.h>
#include <sys/types.h>

typedef int (*alloc_async_fn)(unsigned long long *, size_t, void *);
typedef int (*free_async_fn)(unsigned long long, void *);
static alloc_async_fn alloc_async;
static free_async_fn free_async;

static int load(void) {
    if (alloc_async != NULL && free_async != NULL) return 1;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) return 0;
    alloc_async = (alloc_async_fn)dlsym(lib, "cuMemAllocAsync");
    free_async = (free_async_fn)dlsym(lib, "cuMemFreeAsync");
    return alloc_async != NULL && free_async != NULL;
}

void *ss_alloc(ssize_t size, int device, void *stream) {
    unsigned long long p = 0;
    (void)device;
    if (!load() || alloc_async(&p, (size_t)size, stream) != 0) return NULL;
    return (void *)p;
}

void ss_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)size;
    (void)device;
    if (load()) free_async((unsigned long long)ptr, stream);
}
