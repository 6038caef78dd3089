// Prototype of a native op observer for streamsan (issue 5, item 3): a global RecordFunction callback that
// records, per aten op, the op name and (data pointer, bytes, device) of every tensor input and output into a
// preallocated buffer, the way a native tracer would before handing batches to Python. It measures what such an
// observer costs per op; it is not wired into streamsan.
#include <ATen/record_function.h>
#include <torch/extension.h>

#include <atomic>
#include <vector>

namespace {

struct Access {
  const char* op;  // RecordFunction names are static strings of the dispatcher
  uintptr_t ptr;
  int64_t bytes;
  int32_t device;
  int32_t output;
};

std::vector<Access> g_log;
std::atomic<int64_t> g_ops{0};
at::CallbackHandle g_handle = 0;

template <class Values>
void log_tensors(const char* name, const Values& values, int output) {
  for (const auto& v : values) {
    if (v.isTensor()) {
      const auto& t = v.toTensor();
      if (t.defined() && t.has_storage()) {
        g_log.push_back({name, reinterpret_cast<uintptr_t>(t.storage().data()), (int64_t)t.storage().nbytes(),
                         (int32_t)t.device().index(), output});
      }
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) {
        if (t.defined() && t.has_storage()) {
          g_log.push_back({name, reinterpret_cast<uintptr_t>(t.storage().data()), (int64_t)t.storage().nbytes(),
                           (int32_t)t.device().index(), output});
        }
      }
    }
  }
}

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  g_ops.fetch_add(1, std::memory_order_relaxed);
  log_tensors(fn.name(), fn.inputs(), 0);
  return nullptr;
}

void on_exit(const at::RecordFunction& fn, at::ObserverContext*) {
  log_tensors(fn.name(), fn.outputs(), 1);
}

void enable() {
  if (g_handle) return;
  g_log.reserve(1 << 20);
  g_handle = at::addGlobalCallback(at::RecordFunctionCallback(on_enter, on_exit)
                                       .needsInputs(true)
                                       .needsOutputs(true)
                                       .scopes({at::RecordScope::FUNCTION}));
}

void disable() {
  if (!g_handle) return;
  at::removeCallback(g_handle);
  g_handle = 0;
}

// Drop the recorded accesses (a real tracer would hand them to the analyzer); returns (ops, accesses).
std::pair<int64_t, int64_t> drain() {
  int64_t n = (int64_t)g_log.size();
  g_log.clear();
  return {g_ops.exchange(0), n};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("enable", &enable);
  m.def("disable", &disable);
  m.def("drain", &drain);
}
