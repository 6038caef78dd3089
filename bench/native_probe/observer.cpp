// Prototype of a native op observer for streamsan (issue 5, item 3): a global RecordFunction callback that
// records aten ops into a preallocated buffer, the way a native tracer would before handing batches to Python.
// It measures what such an observer costs per op and whether it sees the ops streamsan's dispatch mode sees; it
// is not wired into streamsan.
//
// Levels (enable(level)):
//   0 raw      every dispatcher call, with (storage pointer, bytes, device) of each tensor input and output;
//   1 visible  only the ops a TorchDispatchMode would see (below), with each tensor's byte range and the
//              current stream of its device;
//   2 stack    level 1 plus the Python call site a tracer keys findings by: the GIL is taken and the innermost
//              three frames are read as (code object, line).
//
// Which ops a dispatch mode sees: RecordFunction fires on every Dispatcher::call (not on redispatch), also for
// the ops kernels call inside themselves. A dispatch mode sees an op when its call reaches the Python key, which
// sits below autograd: a CompositeImplicitAutograd op decomposes above it (the mode sees its parts, not it), and
// an op that reaches it hides everything its kernel calls (the mode is off while it runs). So: outside a visible
// op, an op that would decompose is skipped and its parts are judged one by one; any other op is visible, and
// everything called until it returns is hidden.
#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/extension.h>

#include <atomic>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct Access {
  const void* op;
  uintptr_t begin;
  int64_t bytes;
  int64_t stream;
  int32_t device;
  int32_t output;
};

struct Site {
  const void* code[3];
  int line[3];
};

struct OpInfo {
  bool decomposes_cpu;
  bool decomposes_cuda;
  std::string name;  // "aten::add.Tensor", the way streamsan names ops
};

std::vector<Access> g_log;
std::vector<Site> g_sites;
std::vector<const OpInfo*> g_seen;  // visible ops in order, kept only while g_keep_names
bool g_keep_names = false;
std::atomic<int64_t> g_ops{0};
at::CallbackHandle g_handle = 0;
int g_level = 0;
std::unordered_map<const char*, OpInfo> g_info;  // keyed by the schema's name storage: one per overload
thread_local int t_hidden = 0;                   // > 0 inside a visible op
thread_local std::vector<char> t_stack;          // per open call: 1 visible, 2 hidden, 0 skipped

const OpInfo& info(const at::RecordFunction& fn) {
  auto it = g_info.find(fn.name());
  if (it != g_info.end()) return it->second;
  OpInfo oi{false, false, fn.name()};
  auto opname = fn.operator_name();
  if (opname) {
    if (!opname->overload_name.empty()) oi.name += "." + opname->overload_name;
    auto h = c10::Dispatcher::singleton().findOp(*opname);
    if (h) {
      // the autograd slot of the computed dispatch table runs the CompositeImplicitAutograd ("math") kernel
      std::string table = h->dumpComputedTable();
      auto math = [&](const char* slot) {
        auto at = table.find(slot);
        if (at == std::string::npos) return false;
        auto end = table.find('\n', at + 1);
        return table.substr(at, end - at).find("[math kernel]") != std::string::npos;
      };
      oi.decomposes_cpu = math("\nAutogradCPU:");
      oi.decomposes_cuda = math("\nAutogradCUDA:");
    }
  }
  return g_info.emplace(fn.name(), std::move(oi)).first->second;
}

template <class Values>
void log_raw(const char* name, const Values& values, int output) {
  for (const auto& v : values) {
    if (v.isTensor()) {
      const auto& t = v.toTensor();
      if (t.defined() && t.has_storage()) {
        g_log.push_back({name, reinterpret_cast<uintptr_t>(t.storage().data()), (int64_t)t.storage().nbytes(), 0,
                         (int32_t)t.device().index(), output});
      }
    }
  }
}

inline void log_range(const void* op, const at::Tensor& t, int output) {
  if (!t.defined() || !t.has_storage()) return;
  auto dev = t.device();
  int64_t stream = -1;
  if (dev.is_cuda()) {
    stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(dev).id();
  }
  int64_t item = (int64_t)t.itemsize();
  uintptr_t begin = reinterpret_cast<uintptr_t>(t.storage().data()) + t.storage_offset() * item;
  int64_t bytes = t.is_contiguous() ? t.numel() * item : (int64_t)t.storage().nbytes();
  g_log.push_back({op, begin, bytes, stream, (int32_t)dev.index(), output});
}

template <class Values>
void log_ranges(const void* op, const Values& values, int output) {
  for (const auto& v : values) {
    if (v.isTensor()) {
      log_range(op, v.toTensor(), output);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) log_range(op, t, output);
    }
  }
}

void capture_site() {
  Site s{{nullptr, nullptr, nullptr}, {0, 0, 0}};
  PyGILState_STATE g = PyGILState_Ensure();
  PyFrameObject* f = PyEval_GetFrame();  // borrowed
  if (f) Py_INCREF(f);
  for (int i = 0; i < 3 && f; ++i) {
    PyCodeObject* code = PyFrame_GetCode(f);
    s.code[i] = code;
    s.line[i] = PyFrame_GetLineNumber(f);
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
  PyGILState_Release(g);
  g_sites.push_back(s);
}

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  g_ops.fetch_add(1, std::memory_order_relaxed);
  if (g_level == 0) {
    log_raw(fn.name(), fn.inputs(), 0);
    return nullptr;
  }
  if (t_hidden > 0) {
    ++t_hidden;
    t_stack.push_back(2);
    return nullptr;
  }
  if (c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Python)) {  // e.g. inside torch.tensor()
    t_stack.push_back(0);
    return nullptr;
  }
  const OpInfo& oi = info(fn);
  bool cuda = false;
  for (const auto& v : fn.inputs()) {
    if (v.isTensor()) {
      cuda = v.toTensor().is_cuda();
      break;
    }
  }
  if (cuda ? oi.decomposes_cuda : oi.decomposes_cpu) {
    t_stack.push_back(0);
    return nullptr;
  }
  t_stack.push_back(1);
  t_hidden = 1;
  if (g_keep_names) g_seen.push_back(&oi);
  log_ranges(&oi, fn.inputs(), 0);
  if (g_level >= 2) capture_site();
  return nullptr;
}

void on_exit(const at::RecordFunction& fn, at::ObserverContext*) {
  if (g_level == 0) {
    log_raw(fn.name(), fn.outputs(), 1);
    return;
  }
  if (t_stack.empty()) return;  // the callback was added while this call was open
  char kind = t_stack.back();
  t_stack.pop_back();
  if (kind == 2) {
    --t_hidden;
  } else if (kind == 1) {
    t_hidden = 0;
    log_ranges(g_info[fn.name()].name.c_str(), fn.outputs(), 1);
  }
}

void enable(int level, bool keep_names) {
  if (g_handle) return;
  g_level = level;
  g_keep_names = keep_names;
  g_log.reserve(1 << 20);
  g_sites.reserve(1 << 18);
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

// Drop what was recorded (a real tracer would hand it to the analyzer); returns (ops, accesses, sites).
std::tuple<int64_t, int64_t, int64_t> drain() {
  int64_t n = (int64_t)g_log.size(), s = (int64_t)g_sites.size();
  g_log.clear();
  g_sites.clear();
  return {g_ops.exchange(0), n, s};
}

// The visible ops' names in order since the last call (recorded under enable(level, keep_names=true)).
std::vector<std::string> seen() {
  std::vector<std::string> out;
  out.reserve(g_seen.size());
  for (const OpInfo* oi : g_seen) out.push_back(oi->name);
  g_seen.clear();
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("enable", &enable, py::arg("level") = 0, py::arg("keep_names") = false);
  m.def("disable", &disable);
  m.def("drain", &drain);
  m.def("seen", &seen);
}
