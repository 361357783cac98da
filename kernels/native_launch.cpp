// A replayed launch of a compiled Triton kernel, from C++: the kernel parameters that
// do not change between replays (integers, the tensor maps' sizes, strides and tiles,
// the launch configuration) are laid out once in a plan, and each launch copies the plan
// and writes in what does change (tensor addresses, tensor maps encoded at them), then
// calls cuLaunchKernelEx as Triton's own launcher does.
//
// Why: on the H200's host a replayed mpgemm.matmul spent some 35 of its 57 us between
// triton_gemm's decision to repeat a launch and the driver call: making two
// TensorDescriptor objects, the launch layer's argument list, Triton's Python launcher
// (its scratch allocations, its descriptor expansion) and its C launcher's parsing of
// every argument (bench/results/h200-2026-11-27/run13-at-ebb06bd/profile/profile.md).
// The plan is built by kernels/native_launch.py from the compiled kernel's signature
// and metadata; tests/test_native_launch.py compares what this passes to the driver
// with what Triton's launcher passes, byte for byte, under a stand-in driver.
//
// Only Python's C API and the CUDA driver API (cuda.h from the triton wheel; libcuda
// opened at first use, as Triton opens it), so that it builds in seconds.

#include <Python.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda.h"

namespace {

typedef CUresult (*LaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);
typedef CUresult (*TensorMapEncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                         const cuuint64_t*, const cuuint64_t*,
                                         const cuuint32_t*, const cuuint32_t*,
                                         CUtensorMapInterleave, CUtensorMapSwizzle,
                                         CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
typedef CUresult (*GetErrorString)(CUresult, const char**);
typedef CUresult (*CtxGetCurrent)(CUcontext*);
typedef CUresult (*CtxSetCurrent)(CUcontext);
typedef CUresult (*DeviceGet)(CUdevice*, int);
typedef CUresult (*PrimaryCtxRetain)(CUcontext*, CUdevice);

LaunchKernelEx launch_kernel_ex = nullptr;
TensorMapEncodeTiled encode_tiled = nullptr;
GetErrorString error_string = nullptr;
CtxGetCurrent ctx_get_current = nullptr;
CtxSetCurrent ctx_set_current = nullptr;
DeviceGet device_get = nullptr;
PrimaryCtxRetain primary_ctx_retain = nullptr;

// The driver's entry points, from the libcuda.so.1 the process loads (the one torch and
// Triton use); false, with a Python error set, where it cannot be opened.
bool driver_loaded() {
  if (launch_kernel_ex != nullptr) {
    return true;
  }
  void* library = dlopen("libcuda.so.1", RTLD_LAZY);
  if (library == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "mpgemm native launch: cannot open libcuda.so.1");
    return false;
  }
  encode_tiled = (TensorMapEncodeTiled)dlsym(library, "cuTensorMapEncodeTiled");
  error_string = (GetErrorString)dlsym(library, "cuGetErrorString");
  // (cuda.h maps none of these names to a versioned symbol.)
  ctx_get_current = (CtxGetCurrent)dlsym(library, "cuCtxGetCurrent");
  ctx_set_current = (CtxSetCurrent)dlsym(library, "cuCtxSetCurrent");
  device_get = (DeviceGet)dlsym(library, "cuDeviceGet");
  primary_ctx_retain = (PrimaryCtxRetain)dlsym(library, "cuDevicePrimaryCtxRetain");
  LaunchKernelEx launch = (LaunchKernelEx)dlsym(library, "cuLaunchKernelEx");
  if (encode_tiled == nullptr || error_string == nullptr || ctx_get_current == nullptr ||
      ctx_set_current == nullptr || device_get == nullptr || primary_ctx_retain == nullptr ||
      launch == nullptr) {
    PyErr_SetString(PyExc_RuntimeError,
                    "mpgemm native launch: libcuda.so.1 lacks a driver function it needs");
    return false;
  }
  launch_kernel_ex = launch;
  return true;
}

void set_driver_error(const char* what, CUresult result) {
  const char* text = nullptr;
  if (error_string == nullptr || error_string(result, &text) != CUDA_SUCCESS || text == nullptr) {
    text = "unknown error";
  }
  PyErr_Format(PyExc_RuntimeError, "mpgemm native launch: %s failed: %s (CUresult %d)", what,
               text, (int)result);
}

// A current context on this thread, as Triton's launcher makes sure of before it
// launches (its ensureCudaContext): where none is, device 0's primary context.
bool context_current() {
  CUcontext context = nullptr;
  CUresult result = ctx_get_current(&context);
  if (result == CUDA_SUCCESS && context == nullptr) {
    CUdevice device;
    result = device_get(&device, 0);
    if (result == CUDA_SUCCESS) {
      result = primary_ctx_retain(&context, device);
    }
    if (result == CUDA_SUCCESS) {
      result = ctx_set_current(context);
    }
  }
  if (result != CUDA_SUCCESS) {
    set_driver_error("making a context current", result);
    return false;
  }
  return true;
}

// What a launch writes into a parameter, from the source (the launch's tensor and float
// arguments, in order) of this index: a tensor's address, a tensor map encoded at it,
// or a float rounded to FP32 (as Triton's launcher packs an fp32 parameter).
enum class Fill { address, map, float32 };

struct Slot {
  int source;
  std::size_t offset;  // into the parameter image
  Fill fill;
  // The tensor map's fixed fields, innermost dimension first, as Triton's
  // fillTMADescriptor gives them to cuTensorMapEncodeTiled.
  CUtensorMapDataType dtype;
  cuuint32_t rank;
  cuuint64_t dims[5];
  cuuint64_t strides[5];  // bytes, rank - 1 of them
  cuuint32_t box[5];
  CUtensorMapSwizzle swizzle;
  CUtensorMapFloatOOBfill oob_fill;
  // The map last encoded and the address it was encoded at: a launch at the same
  // address (a weight's compute copy, a benchmark's operands) copies it instead of
  // encoding anew. Read and written with the GIL held.
  bool encoded;
  std::uint64_t encoded_at;
  CUtensorMap map;
};

struct Plan {
  CUfunction function;
  unsigned int grid[3];
  unsigned int threads;
  unsigned int shared;
  bool pdl;
  bool cooperative;
  int sources;
  std::vector<std::size_t> offsets;  // each kernel parameter's, into the image
  std::vector<unsigned char> image;  // every parameter laid out, addresses 0
  std::vector<Slot> slots;
};

const char* kCapsule = "mpgemm.native_launch.Plan";
const std::size_t kMaxParameters = 256;

void free_plan(PyObject* capsule) {
  delete static_cast<Plan*>(PyCapsule_GetPointer(capsule, kCapsule));
}

std::size_t aligned(std::size_t offset, std::size_t alignment) {
  return (offset + alignment - 1) / alignment * alignment;
}

bool read_u64s(PyObject* sequence, cuuint64_t* out, Py_ssize_t count, const char* what) {
  if (!PyTuple_Check(sequence) || PyTuple_GET_SIZE(sequence) != count) {
    PyErr_Format(PyExc_ValueError, "mpgemm native launch: %s must be a tuple of %zd", what,
                 count);
    return false;
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    out[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(sequence, i));
    if (PyErr_Occurred()) {
      return false;
    }
  }
  return true;
}

// plan(function, grid, threads, shared, pdl, cooperative, params) -> capsule.
// params: one tuple per kernel parameter, in order:
//   ("bytes", b): a constant, b its bytes in native order (an integer, a null pointer);
//   ("address", source): the address (data_ptr) of source `source`, a tensor;
//   ("map", source, dtype, dims, strides, box, swizzle, fill): a 128-byte tensor map of
//   source `source`'s address, dims/box innermost first, strides in bytes;
//   ("float32", source): source `source`, a float, rounded to FP32.
PyObject* plan(PyObject*, PyObject* args) {
  unsigned long long function;
  unsigned int gx, gy, gz, threads, shared;
  int pdl, cooperative;
  PyObject* params;
  if (!PyArg_ParseTuple(args, "K(III)IIppO!", &function, &gx, &gy, &gz, &threads, &shared, &pdl,
                        &cooperative, &PyTuple_Type, &params)) {
    return nullptr;
  }
  auto result = new Plan();
  Plan& p = *result;
  p.function = reinterpret_cast<CUfunction>(function);
  p.grid[0] = gx;
  p.grid[1] = gy;
  p.grid[2] = gz;
  p.threads = threads;
  p.shared = shared;
  p.pdl = pdl;
  p.cooperative = cooperative;
  p.sources = 0;
  std::size_t size = 0;
  // First the layout (each parameter at its alignment; tensor maps at 64 bytes), then
  // the image.
  std::vector<std::pair<PyObject*, std::size_t>> constants;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(params); ++i) {
    PyObject* param = PyTuple_GET_ITEM(params, i);
    const char* kind = nullptr;
    if (!PyTuple_Check(param) || PyTuple_GET_SIZE(param) < 2 ||
        (kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(param, 0))) == nullptr) {
      delete result;
      if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "mpgemm native launch: a parameter must be (kind, ...)");
      }
      return nullptr;
    }
    if (std::strcmp(kind, "bytes") == 0) {
      PyObject* bytes = PyTuple_GET_ITEM(param, 1);
      if (!PyBytes_Check(bytes) || PyBytes_GET_SIZE(bytes) == 0 || PyBytes_GET_SIZE(bytes) > 8) {
        delete result;
        PyErr_SetString(PyExc_ValueError, "mpgemm native launch: a constant is 1 to 8 bytes");
        return nullptr;
      }
      std::size_t width = PyBytes_GET_SIZE(bytes);
      size = aligned(size, width);
      p.offsets.push_back(size);
      constants.emplace_back(bytes, size);
      size += width;
      continue;
    }
    Slot slot{};
    slot.source = (int)PyLong_AsLong(PyTuple_GET_ITEM(param, 1));
    if (std::strcmp(kind, "address") == 0) {
      slot.fill = Fill::address;
      size = aligned(size, 8);
      slot.offset = size;
      size += 8;
    } else if (std::strcmp(kind, "float32") == 0) {
      slot.fill = Fill::float32;
      size = aligned(size, 4);
      slot.offset = size;
      size += 4;
    } else if (std::strcmp(kind, "map") == 0 && PyTuple_GET_SIZE(param) == 8) {
      slot.fill = Fill::map;
      slot.dtype = (CUtensorMapDataType)PyLong_AsLong(PyTuple_GET_ITEM(param, 2));
      PyObject* dims = PyTuple_GET_ITEM(param, 3);
      slot.rank = PyTuple_Check(dims) ? (cuuint32_t)PyTuple_GET_SIZE(dims) : 0;
      cuuint64_t box[5];
      if (slot.rank < 1 || slot.rank > 5 || !read_u64s(dims, slot.dims, slot.rank, "dims") ||
          !read_u64s(PyTuple_GET_ITEM(param, 4), slot.strides, slot.rank - 1, "strides") ||
          !read_u64s(PyTuple_GET_ITEM(param, 5), box, slot.rank, "box")) {
        delete result;
        if (!PyErr_Occurred()) {
          PyErr_SetString(PyExc_ValueError, "mpgemm native launch: a map has rank 1 to 5");
        }
        return nullptr;
      }
      for (cuuint32_t d = 0; d < slot.rank; ++d) {
        slot.box[d] = (cuuint32_t)box[d];
      }
      slot.swizzle = (CUtensorMapSwizzle)PyLong_AsLong(PyTuple_GET_ITEM(param, 6));
      slot.oob_fill = (CUtensorMapFloatOOBfill)PyLong_AsLong(PyTuple_GET_ITEM(param, 7));
      size = aligned(size, 64);
      slot.offset = size;
      size += sizeof(CUtensorMap);
    } else {
      delete result;
      PyErr_Format(PyExc_ValueError, "mpgemm native launch: unknown parameter kind %s", kind);
      return nullptr;
    }
    if (PyErr_Occurred()) {
      delete result;
      return nullptr;
    }
    p.offsets.push_back(slot.offset);
    p.sources = slot.source + 1 > p.sources ? slot.source + 1 : p.sources;
    p.slots.push_back(slot);
  }
  if (p.offsets.size() > kMaxParameters) {
    delete result;
    PyErr_SetString(PyExc_ValueError, "mpgemm native launch: more than 256 parameters");
    return nullptr;
  }
  p.image.assign(size, 0);
  for (auto& constant : constants) {
    std::memcpy(p.image.data() + constant.second, PyBytes_AS_STRING(constant.first),
                PyBytes_GET_SIZE(constant.first));
  }
  PyObject* capsule = PyCapsule_New(result, kCapsule, free_plan);
  if (capsule == nullptr) {
    delete result;
  }
  return capsule;
}

PyObject* data_ptr_name = nullptr;

// A tensor's address, as Triton's launcher reads it (data_ptr()).
bool address_of(PyObject* tensor, std::uint64_t& address) {
  PyObject* value = PyObject_CallMethodNoArgs(tensor, data_ptr_name);
  if (value == nullptr) {
    return false;
  }
  address = PyLong_AsUnsignedLongLong(value);
  Py_DECREF(value);
  return !PyErr_Occurred();
}

// launch(plan, stream, *sources): the plan's kernel on `stream` (a CUstream as an
// integer), its address, tensor-map and float parameters read from `sources`.
PyObject* launch(PyObject*, PyObject* const* args, Py_ssize_t count) {
  if (count < 2) {
    PyErr_SetString(PyExc_TypeError, "mpgemm native launch: launch(plan, stream, *sources)");
    return nullptr;
  }
  auto plan = static_cast<Plan*>(PyCapsule_GetPointer(args[0], kCapsule));
  if (plan == nullptr) {
    return nullptr;
  }
  if (count - 2 != plan->sources) {
    PyErr_Format(PyExc_TypeError, "mpgemm native launch: the plan takes %d sources, not %zd",
                 plan->sources, count - 2);
    return nullptr;
  }
  CUstream stream = reinterpret_cast<CUstream>(PyLong_AsUnsignedLongLong(args[1]));
  if (PyErr_Occurred() || !driver_loaded() || !context_current()) {
    return nullptr;
  }
  // The image, with tensor maps at 64-byte boundaries: the buffer's start is one.
  alignas(64) unsigned char stack[1024];
  std::vector<unsigned char> heap;
  unsigned char* image = stack;
  if (plan->image.size() > sizeof(stack)) {
    heap.resize(plan->image.size() + 64);
    image = reinterpret_cast<unsigned char*>(aligned(reinterpret_cast<std::size_t>(heap.data()), 64));
  }
  std::memcpy(image, plan->image.data(), plan->image.size());
  for (Slot& slot : plan->slots) {
    PyObject* source = args[2 + slot.source];
    if (slot.fill == Fill::float32) {
      float value = (float)PyFloat_AsDouble(source);
      if (PyErr_Occurred()) {
        return nullptr;
      }
      std::memcpy(image + slot.offset, &value, 4);
      continue;
    }
    std::uint64_t address;
    if (!address_of(source, address)) {
      return nullptr;
    }
    if (slot.fill == Fill::address) {
      std::memcpy(image + slot.offset, &address, 8);
      continue;
    }
    if (!slot.encoded || slot.encoded_at != address) {
      cuuint32_t unit[5] = {1, 1, 1, 1, 1};
      slot.encoded = false;
      CUresult result = encode_tiled(
          &slot.map, slot.dtype, slot.rank, reinterpret_cast<void*>(address), slot.dims,
          slot.strides, slot.box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, slot.swizzle,
          CU_TENSOR_MAP_L2_PROMOTION_L2_128B, slot.oob_fill);
      if (result != CUDA_SUCCESS) {
        set_driver_error("cuTensorMapEncodeTiled", result);
        return nullptr;
      }
      slot.encoded = true;
      slot.encoded_at = address;
    }
    std::memcpy(image + slot.offset, &slot.map, sizeof(CUtensorMap));
  }
  void* params[kMaxParameters];
  std::size_t parameters = plan->offsets.size();
  for (std::size_t i = 0; i < parameters; ++i) {
    params[i] = image + plan->offsets[i];
  }
  CUlaunchAttribute attributes[2] = {};  // zeroed, as Triton's designated initialisers do
  unsigned int attribute_count = 0;
  if (plan->pdl) {
    attributes[attribute_count].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attributes[attribute_count].value.programmaticStreamSerializationAllowed = 1;
    ++attribute_count;
  }
  if (plan->cooperative) {
    attributes[attribute_count].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attributes[attribute_count].value.cooperative = 1;
    ++attribute_count;
  }
  CUlaunchConfig config{};
  config.gridDimX = plan->grid[0];
  config.gridDimY = plan->grid[1];
  config.gridDimZ = plan->grid[2];
  config.blockDimX = plan->threads;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = plan->shared;
  config.hStream = stream;
  config.attrs = attributes;
  config.numAttrs = attribute_count;
  // Without the GIL, as Triton's launcher: the call blocks while the launch queue is
  // full, and other threads (autograd's device threads among them) go on meanwhile.
  CUresult result;
  Py_BEGIN_ALLOW_THREADS;
  result = launch_kernel_ex(&config, plan->function, params, nullptr);
  Py_END_ALLOW_THREADS;
  if (result != CUDA_SUCCESS) {
    set_driver_error("cuLaunchKernelEx", result);
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"plan", plan, METH_VARARGS, "A kernel's launch plan (see native_launch.cpp)."},
    {"launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(launch)),
     METH_FASTCALL, "launch(plan, stream, *sources): the planned launch."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "mpgemm_native_launch", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_mpgemm_native_launch() {
  data_ptr_name = PyUnicode_InternFromString("data_ptr");
  if (data_ptr_name == nullptr) {
    return nullptr;
  }
  return PyModule_Create(&module);
}
