/* A PyInterpreterVTable of streamsan's own (StubVTable) and the PyInterpreter made of one (interpreter_of).
 *
 * PyInterpreterVTable's methods differ between torch versions: every spelling known is declared here (the matching
 * one overrides, the others are plain members); interpreter_of<V>() is null where this torch has a pure virtual
 * method that none of them matches. Every method is unused (an internal assertion) but reference counting (none:
 * the objects tagged with such an interpreter are kept alive by their owner) and the GPU-trace methods (nothing);
 * a subclass overrides what it is for: the GPU-trace slot's interpreter (observer.cpp) its trace methods, the
 * dispatch lane's (lane.cpp) dispatch().
 */
#pragma once

#include <c10/core/impl/PyInterpreter.h>

#include <string>
#include <type_traits>

namespace c10::impl {
struct PyObjectSlot;  // (named by some torch versions' PyInterpreterVTable)
}

namespace streamsan {

using c10::DispatchKey;
using c10::DispatchKeySet;

struct StubVTable : public c10::impl::PyInterpreterVTable {
  using DT = c10::DeviceType;
  [[noreturn]] static void unused(const char* what) {
    TORCH_INTERNAL_ASSERT(false, "streamsan's interpreter has no ", what);
  }
  std::string name() const { return "<streamsan native observer>"; }
  void incref(PyObject*) const {}
  void decref(PyObject*) const {}
  void decref(PyObject*, bool) const {}
  bool try_incref(const c10::impl::PyObjectSlot&) const { return false; }
  size_t refcnt(PyObject*) const { return 0; }
  c10::intrusive_ptr<c10::TensorImpl> detach(const c10::TensorImpl*) const { unused("detach"); }
  void dispatch(const c10::OperatorHandle&, torch::jit::Stack*) const { unused("dispatch"); }
  void reportErrorCallback(PyObject*, DispatchKey) const { unused("reportErrorCallback"); }
  void python_op_registration_trampoline(const c10::OperatorHandle&, DispatchKey, DispatchKeySet,
                                         torch::jit::Stack*, bool, bool) const {
    unused("python_op_registration_trampoline");
  }
  void python_op_registration_trampoline(const c10::OperatorHandle&, DispatchKey, DispatchKeySet,
                                         torch::jit::Stack*, bool) const {
    unused("python_op_registration_trampoline");
  }
  void python_op_registration_trampoline(const c10::OperatorHandle&, DispatchKey, torch::jit::Stack*) const {
    unused("python_op_registration_trampoline");
  }
  void throw_abstract_impl_not_imported_error(std::string, const char*, const char*) const {
    unused("throw_abstract_impl_not_imported_error");
  }
  void python_dispatcher(const c10::OperatorHandle&, DispatchKeySet, torch::jit::Stack*) const {
    unused("python_dispatcher");
  }
  bool is_contiguous(const c10::TensorImpl*, at::MemoryFormat) const { unused("is_contiguous"); }
  c10::SymBool sym_is_contiguous(const c10::TensorImpl*, at::MemoryFormat) const { unused("sym_is_contiguous"); }
  bool is_strides_like(const c10::TensorImpl*, at::MemoryFormat) const { unused("is_strides_like"); }
  bool is_non_overlapping_and_dense(const c10::TensorImpl*) const { unused("is_non_overlapping_and_dense"); }
  c10::Device device(const c10::TensorImpl*) const { unused("device"); }
  int64_t dim(const c10::TensorImpl*) const { unused("dim"); }
  c10::IntArrayRef strides(const c10::TensorImpl*) const { unused("strides"); }
  c10::IntArrayRef sizes(const c10::TensorImpl*) const { unused("sizes"); }
  c10::SymIntArrayRef sym_sizes(const c10::TensorImpl*) const { unused("sym_sizes"); }
  c10::Layout layout(const c10::TensorImpl*) const { unused("layout"); }
  int64_t numel(const c10::TensorImpl*) const { unused("numel"); }
  c10::SymInt sym_numel(const c10::TensorImpl*) const { unused("sym_numel"); }
  c10::SymIntArrayRef sym_strides(const c10::TensorImpl*) const { unused("sym_strides"); }
  c10::SymInt sym_storage_offset(const c10::TensorImpl*) const { unused("sym_storage_offset"); }
  void reset_backward_hooks(const c10::TensorImpl*) const { unused("reset_backward_hooks"); }

  void trace_gpu_event_creation(DT, uintptr_t) const {}
  void trace_gpu_event_deletion(DT, uintptr_t) const {}
  void trace_gpu_event_record(DT, uintptr_t, uintptr_t) const {}
  void trace_gpu_event_wait(DT, uintptr_t, uintptr_t) const {}
  void trace_gpu_memory_allocation(DT, uintptr_t) const {}
  void trace_gpu_memory_deallocation(DT, uintptr_t) const {}
  void trace_gpu_stream_creation(DT, uintptr_t) const {}
  void trace_gpu_device_synchronization(DT) const {}
  void trace_gpu_stream_synchronization(DT, uintptr_t) const {}
  void trace_gpu_event_synchronization(DT, uintptr_t) const {}
  // (torch versions whose trace methods name no device type)
  void trace_gpu_event_creation(uintptr_t) const {}
  void trace_gpu_event_deletion(uintptr_t) const {}
  void trace_gpu_event_record(uintptr_t, uintptr_t) const {}
  void trace_gpu_event_wait(uintptr_t, uintptr_t) const {}
  void trace_gpu_memory_allocation(uintptr_t) const {}
  void trace_gpu_memory_deallocation(uintptr_t) const {}
  void trace_gpu_stream_creation(uintptr_t) const {}
  void trace_gpu_device_synchronization() const {}
  void trace_gpu_stream_synchronization(uintptr_t) const {}
  void trace_gpu_event_synchronization(uintptr_t) const {}
};

/* The interpreter of a VTable (one per VTable, for the process), or null where this torch's PyInterpreterVTable has
 * a method VTable does not implement. */
template <class VTable>
c10::impl::PyInterpreter* interpreter_of() {
  if constexpr (std::is_abstract_v<VTable>) {
    return nullptr;
  } else {
    static const VTable* vtable = new VTable;
    static c10::impl::PyInterpreter* interpreter = new c10::impl::PyInterpreter(vtable);
    return interpreter;
  }
}

}  // namespace streamsan
