// What the loss-scaling ops ask of every tensor of a list, read in one pass in C++;
// and the version bump of every tensor they write.
//
// Each tensor attribute read from Python (dtype, is_contiguous, data_ptr, ...) costs 60
// to 80 ns through torch's bindings, even mapped in C: about 14 us per pass over 200
// tensors, and an unscale or optimizer step makes several passes over each of its
// lists. Here the whole list is read at C++ speed (mpgemm/native.py loads this file
// with torch's JIT extension builder; without a compiler the passes stay in Python).

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

// A list or tuple's items: the sequence PySequence_Fast makes of it (held by owner,
// which must outlive the items), raising TypeError with message for anything else.
PyObject** fast_items(py::handle sequence, const char* message, py::object& owner,
                      Py_ssize_t& count) {
  PyObject* fast = PySequence_Fast(sequence.ptr(), message);
  if (fast == nullptr) {
    throw py::error_already_set();
  }
  owner = py::reinterpret_steal<py::object>(fast);
  count = PySequence_Fast_GET_SIZE(fast);
  return PySequence_Fast_ITEMS(fast);
}

// (plain, dtypes, devices, contiguous, shapes, numels, addresses, inference) of a list
// or tuple of tensors. plain: every item's type is one of plain_types (a tuple of
// types) and its values are its memory's (not a negative view, whose values are its
// memory's negated, nor a zero tensor, which has no memory: a kernel would read the
// wrong sign, or nothing); when not, only plain (False) is meaningful and the rest is
// left empty, since a subclass's metadata may call back into Python or have no
// storage. dtypes: the set of the tensors' torch.dtype objects; devices: the set of
// their device indices (-1 for the CPU, as Tensor.get_device); contiguous: all are
// contiguous; shapes: each tensor's ndim then its sizes, as int64s; numels and
// addresses (data_ptr): an int64 per tensor, native byte order; inference: any is an
// inference tensor (made under torch.inference_mode, which torch's in-place ops write
// only there).
py::tuple list_facts(py::handle sequence, py::handle plain_types) {
  py::object owner;
  Py_ssize_t count = 0;
  PyObject** items = fast_items(sequence, "list_facts: expected a list or tuple", owner, count);
  PyObject* types = plain_types.ptr();
  if (!PyTuple_Check(types)) {
    throw py::type_error("list_facts: plain_types must be a tuple of types");
  }
  const Py_ssize_t type_count = PyTuple_GET_SIZE(types);

  bool plain = true;
  for (Py_ssize_t i = 0; i < count && plain; ++i) {
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(items[i]));
    bool listed = false;
    for (Py_ssize_t k = 0; k < type_count && !listed; ++k) {
      listed = PyTuple_GET_ITEM(types, k) == type;
    }
    plain = listed && THPVariable_Check(items[i]);
    if (plain) {
      const at::Tensor& t = THPVariable_Unpack(items[i]);
      plain = !t.is_neg() && !t._is_zerotensor();
    }
  }
  py::set dtypes, devices;
  if (!plain) {
    return py::make_tuple(
        false, dtypes, devices, false, py::bytes(), py::bytes(), py::bytes(), false);
  }

  std::string numels(count * sizeof(int64_t), '\0');
  std::string addresses(count * sizeof(int64_t), '\0');
  std::string shapes;
  shapes.reserve(count * 3 * sizeof(int64_t));
  auto* numel = reinterpret_cast<int64_t*>(&numels[0]);
  auto* address = reinterpret_cast<int64_t*>(&addresses[0]);
  bool contiguous = true;
  bool inference = false;
  // The sets change only where a tensor differs from the one before it.
  bool first = true;
  at::ScalarType last_dtype = at::ScalarType::Undefined;
  int64_t last_device = 0;
  for (Py_ssize_t i = 0; i < count; ++i) {
    const at::Tensor& t = THPVariable_Unpack(items[i]);
    numel[i] = t.numel();
    // (A tensor without storage, such as one a torch.func transform wraps, raises here
    // as its data_ptr() does in Python: no table may hold an address it lacks.)
    address[i] = reinterpret_cast<int64_t>(t.data_ptr());
    contiguous = contiguous && t.is_contiguous();
    inference = inference || t.is_inference();
    const int64_t ndim = t.dim();
    shapes.append(reinterpret_cast<const char*>(&ndim), sizeof(ndim));
    for (int64_t size : t.sizes()) {
      shapes.append(reinterpret_cast<const char*>(&size), sizeof(size));
    }
    const at::ScalarType dtype = t.scalar_type();
    const int64_t device = t.get_device();
    if (first || dtype != last_dtype) {
      dtypes.add(py::handle(reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype))));
      last_dtype = dtype;
    }
    if (first || device != last_device) {
      devices.add(py::int_(device));
      last_device = device;
    }
    first = false;
  }
  return py::make_tuple(
      true, dtypes, devices, contiguous, py::bytes(shapes), py::bytes(numels),
      py::bytes(addresses), inference);
}

// Bump the version counter of every tensor of a list or tuple, as torch's in-place ops
// do, for what a kernel wrote in place: autograd then refuses a saved tensor changed
// since it was saved. An inference tensor has no version counter and is skipped (as
// torch.autograd.graph.increment_version skips it); an item that is not a tensor
// raises RuntimeError, as there. (increment_version converts the list into a vector of
// tensors first: some 75 ns a tensor, where this loop takes a few.)
void bump_versions(py::handle sequence) {
  py::object owner;
  Py_ssize_t count = 0;
  PyObject** items =
      fast_items(sequence, "bump_versions: expected a list or tuple", owner, count);
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (!THPVariable_Check(items[i])) {
      throw std::runtime_error(
          "bump_versions expects each element of the iterable to be a tensor");
    }
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    const at::Tensor& t = THPVariable_Unpack(items[i]);
    if (!t.is_inference()) {
      t.unsafeGetTensorImpl()->bump_version();
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("list_facts", &list_facts, "What the loss-scaling ops ask of a list of tensors");
  m.def("bump_versions", &bump_versions, "Bump each tensor's version counter");
}
