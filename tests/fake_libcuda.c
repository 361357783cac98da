/* A stand-in for the CUDA driver (libcuda.so.1) on a machine without a GPU, for
 * tests/test_native_launch.py: it answers what triton's driver utilities and launchers
 * ask at load and launch time, runs nothing, and records each kernel launch (its
 * configuration and the bytes of its parameters) and each tensor map encoded (its
 * arguments, written into the map's 128 bytes), so that two launchers can be compared
 * byte for byte. Built against the cuda.h that ships in the triton wheel, so that every
 * versioned name (cuCtxGetCurrent and the like) is the symbol the callers link. */
#include "cuda.h"

#include <stdint.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

/* Each function's parameter sizes, which the caller (the test) reads from the kernel's
 * PTX: the driver finds them in the binary, which this stand-in never reads. A launch
 * of a function with no sizes given records no parameters. */
#define FUNCTIONS 4096
#define LOGGED 16
static int functions[FUNCTIONS], function_count;
static uint64_t param_sizes[FUNCTIONS][256];
static int param_counts[FUNCTIONS];

typedef struct {
  CUlaunchConfig config;
  CUlaunchAttribute attrs[8];
  CUfunction function;
  uint64_t params_size;
  unsigned char params[4096];
} Launch;

/* The launches since the last fake_clear: all counted, the first LOGGED recorded. */
static Launch logged[LOGGED];
static int launches;
static int encodes;

EXPORT void fake_set_param_sizes(CUfunction f, int count, const uint64_t *sizes) {
  int index = (int *)f - functions;
  param_counts[index] = count;
  memcpy(param_sizes[index], sizes, count * sizeof(uint64_t));
}

EXPORT void fake_clear(void) { launches = encodes = 0; }
EXPORT int fake_launches(void) { return launches; }
EXPORT int fake_recorded(void) { return launches < LOGGED ? launches : LOGGED; }
EXPORT int fake_encodes(void) { return encodes; }

/* Launch ``i``: its parameters' bytes into ``params`` (returns their size); its grid,
 * block, shared memory, stream, function and attribute count into ``config``; each
 * attribute's id and the 64 bytes of its value into ``attrs`` (72 bytes each). */
EXPORT uint64_t fake_launch(int i, unsigned char *params, uint64_t *config,
                            unsigned char *attrs) {
  const Launch *l = &logged[i];
  memcpy(params, l->params, l->params_size);
  config[0] = l->config.gridDimX;
  config[1] = l->config.gridDimY;
  config[2] = l->config.gridDimZ;
  config[3] = l->config.blockDimX;
  config[4] = l->config.blockDimY;
  config[5] = l->config.blockDimZ;
  config[6] = l->config.sharedMemBytes;
  config[7] = (uint64_t)(uintptr_t)l->config.hStream;
  config[8] = (uint64_t)(uintptr_t)l->function;
  config[9] = l->config.numAttrs;
  for (unsigned int a = 0; a < l->config.numAttrs; ++a) {
    uint64_t id = l->attrs[a].id;
    memcpy(attrs + 72 * a, &id, 8);
    memcpy(attrs + 72 * a + 8, &l->attrs[a].value, 64);
  }
  return l->params_size;
}

/* The context current on each thread: none until one is set, as the driver's. */
static __thread CUcontext current;

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra) {
  if (current == NULL)
    return CUDA_ERROR_INVALID_CONTEXT; /* as the driver answers a thread without one */
  if (config->numAttrs > 8 || extra != NULL)
    return CUDA_ERROR_INVALID_VALUE;
  if (launches >= LOGGED) {
    launches += 1;
    return CUDA_SUCCESS;
  }
  Launch *l = &logged[launches];
  int index = (int *)f - functions;
  uint64_t offset = 0;
  for (int i = 0; i < param_counts[index]; ++i) {
    if (offset + param_sizes[index][i] > sizeof(l->params))
      return CUDA_ERROR_INVALID_VALUE;
    memcpy(l->params + offset, kernelParams[i], param_sizes[index][i]);
    offset += param_sizes[index][i];
  }
  l->params_size = offset;
  l->config = *config;
  memset(l->attrs, 0, sizeof(l->attrs));
  memcpy(l->attrs, config->attrs, config->numAttrs * sizeof(CUlaunchAttribute));
  l->function = f;
  launches += 1;
  return CUDA_SUCCESS;
}

CUresult cuTensorMapEncodeTiled(CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType,
                                cuuint32_t tensorRank, void *globalAddress,
                                const cuuint64_t *globalDim, const cuuint64_t *globalStrides,
                                const cuuint32_t *boxDim, const cuuint32_t *elementStrides,
                                CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                CUtensorMapL2promotion l2Promotion,
                                CUtensorMapFloatOOBfill oobFill) {
  /* 128 bytes: 8 of the address, then 30 four-byte words of the rest. A rank of at
   * most 3 keeps it within the map. */
  if (tensorRank < 1 || tensorRank > 3)
    return CUDA_ERROR_INVALID_VALUE;
  uint32_t words[30] = {0};
  int w = 0;
  words[w++] = tensorDataType;
  words[w++] = tensorRank;
  for (cuuint32_t i = 0; i < tensorRank; ++i) {
    words[w++] = (uint32_t)globalDim[i];
    words[w++] = (uint32_t)(globalDim[i] >> 32);
    words[w++] = boxDim[i];
    words[w++] = elementStrides[i];
  }
  for (cuuint32_t i = 0; i + 1 < tensorRank; ++i) {
    words[w++] = (uint32_t)globalStrides[i];
    words[w++] = (uint32_t)(globalStrides[i] >> 32);
  }
  words[w++] = interleave;
  words[w++] = swizzle;
  words[w++] = l2Promotion;
  words[w++] = oobFill;
  memset(tensorMap, 0, sizeof(CUtensorMap));
  uint64_t address = (uint64_t)(uintptr_t)globalAddress;
  memcpy(tensorMap, &address, 8);
  memcpy((unsigned char *)tensorMap + 8, words, sizeof(words));
  encodes += 1;
  return CUDA_SUCCESS;
}

/* What triton asks at load time: a device, a context, a module and a function. */
static int context, module;

CUresult cuInit(unsigned int flags) { return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *version) {
  *version = 12080;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int *count) {
  *count = 1;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice *device, int ordinal) {
  *device = ordinal;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attribute, CUdevice device) {
  switch (attribute) {
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN:
    *value = 232448;
    break;
  case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
    *value = 132;
    break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
    *value = 9;
    break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
    *value = 0;
    break;
  default:
    *value = 1024;
  }
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  *pctx = (CUcontext)&context;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext *pctx) {
  *pctx = current;
  return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext ctx) {
  current = ctx;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetDevice(CUdevice *device) {
  *device = 0;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetLimit(size_t *value, CUlimit limit) {
  *value = 1 << 20;
  return CUDA_SUCCESS;
}
CUresult cuCtxSetLimit(CUlimit limit, size_t value) { return CUDA_SUCCESS; }
CUresult cuModuleLoadData(CUmodule *mod, const void *image) {
  *mod = (CUmodule)&module;
  return CUDA_SUCCESS;
}
CUresult cuModuleUnload(CUmodule mod) { return CUDA_SUCCESS; }
CUresult cuModuleGetFunction(CUfunction *f, CUmodule mod, const char *name) {
  /* A handle of its own for each function loaded, so that a launch names which (and
   * its parameter sizes are its own). */
  if (function_count == FUNCTIONS)
    return CUDA_ERROR_OUT_OF_MEMORY;
  *f = (CUfunction)&functions[function_count++];
  return CUDA_SUCCESS;
}
CUresult cuFuncGetAttribute(int *value, CUfunction_attribute attribute, CUfunction f) {
  /* 128 registers, no spills, up to 1024 threads. */
  *value = attribute == CU_FUNC_ATTRIBUTE_NUM_REGS                ? 128
           : attribute == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ? 1024
                                                                  : 0;
  return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute attribute, int value) {
  return CUDA_SUCCESS;
}
CUresult cuFuncSetCacheConfig(CUfunction f, CUfunc_cache config) { return CUDA_SUCCESS; }
CUresult cuOccupancyMaxActiveClusters(int *count, CUfunction f, const CUlaunchConfig *config) {
  *count = 132;
  return CUDA_SUCCESS;
}
/* Every address is a device's, as itself (the tensors are the CPU's). */
CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  if (attribute == CU_POINTER_ATTRIBUTE_DEVICE_POINTER)
    *(CUdeviceptr *)data = ptr;
  else
    memset(data, 0, sizeof(CUdeviceptr));
  return CUDA_SUCCESS;
}
CUresult cuPointerGetAttributes(unsigned int count, CUpointer_attribute *attributes, void **data,
                                CUdeviceptr ptr) {
  for (unsigned int i = 0; i < count; ++i)
    cuPointerGetAttribute(data[i], attributes[i], ptr);
  return CUDA_SUCCESS;
}
CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status) {
  *status = CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}
CUresult cuGetErrorString(CUresult error, const char **str) {
  *str = "fake libcuda error";
  return CUDA_SUCCESS;
}
