/* A stand-in for the CUDA driver library (libcuda.so.1), for running SGLang's CPU server on a machine
 * without an NVIDIA driver. Built by gspo_megatron/rollout/sglang/cpu.py into the cache folder and put
 * on the server's LD_LIBRARY_PATH only when rollout.sglang.launch.device is "cpu".
 *
 * Why it exists: the only sglang-kernel wheel on the package registry (0.4.10, CUDA builds only) lists
 * libcuda.so.1 as a NEEDED library and calls one driver function, cuPointerGetAttribute; SGLang 0.5.23's
 * CPU path imports it unconditionally (sglang/kernels/ops/kvcache/cache_move.py), so without a libcuda
 * the CPU server cannot even start. Every function here answers CUDA_ERROR_NO_DEVICE (100) and zeroes
 * its output: torch still sees no GPU, and any code path that did reach the driver fails loudly. */
#include <stddef.h>
#include <string.h>

#define CUDA_ERROR_NO_DEVICE 100

int cuInit(unsigned int flags) { (void)flags; return CUDA_ERROR_NO_DEVICE; }

int cuDriverGetVersion(int *version) {
    if (version) *version = 0;
    return CUDA_ERROR_NO_DEVICE;
}

int cuDeviceGetCount(int *count) {
    if (count) *count = 0;
    return CUDA_ERROR_NO_DEVICE;
}

/* The output's size depends on the attribute asked for (4 or 8 bytes); only the 4 bytes every one
 * of them has are zeroed, so a 4-byte output is never overrun. */
int cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
    (void)attribute; (void)ptr;
    if (data) memset(data, 0, sizeof(unsigned int));
    return CUDA_ERROR_NO_DEVICE;
}
