/* A do-nothing CUDA driver for GPU-less tests of FlashBoot's driver paths (tests/test_cuda_path_stub.py).
 * cuda-bindings resolves every entry point through cuGetProcAddress_v2: the ones defined here answer,
 * every other returns CUDA_SUCCESS and writes nothing. No memory is touched: nothing is copied. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

static int generic(void) { return 0; }
int cuInit(unsigned flags) { return 0; }
int cuDriverGetVersion(int *version) { *version = 13000; return 0; }
int cuDeviceGetCount(int *count) { *count = 1; return 0; }
int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return 0; }
int cuCtxGetDevice(int *device) { *device = 0; return 0; }
/* STUB_NOT_READY set: no queued work ever completes (a stream blocked for good). */
int cuEventQuery(void *event) { return getenv("STUB_NOT_READY") ? 600 /* CUDA_ERROR_NOT_READY */ : 0; }
int cuEventSynchronize(void *event) {
  while (getenv("STUB_NOT_READY")) pause(); /* blocks for good, as the driver would on such a stream */
  return 0;
}
int cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
  void *p = dlsym(RTLD_DEFAULT, symbol);
  *pfn = p ? p : (void *)generic;
  if (status) *status = 0;
  return 0;
}
int cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
  return cuGetProcAddress_v2(symbol, pfn, version, flags, 0);
}
/* What flashboot.kernels.launch_ctypes binds by name (it does not go through cuGetProcAddress). */
int cuGetErrorName(int error, const char **name) { return 1; }
int cuGetErrorString(int error, const char **text) { return 1; }
int cuDeviceGetAttribute(int *value, int attribute, int device) { *value = 0; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int device) { *ctx = (void *)0x1; return 0; }
int cuCtxGetCurrent(void **ctx) { *ctx = (void *)0x1; return 0; }
int cuCtxSetCurrent(void *ctx) { return 0; }
int cuModuleLoadData(void **module, const void *image) { *module = (void *)0x2; return 0; }
int cuModuleGetFunction(void **function, void *module, const char *name) { *function = (void *)0x3; return 0; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void *stream, void **params, void **extra) { return 0; }
