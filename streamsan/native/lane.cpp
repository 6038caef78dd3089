/* streamsan's dispatch lane: the torch tracer's dispatch mode, entered without PyTorch's Python dispatch.
 *
 * The lane is a dispatch mode whose interpreter is this file's (LaneVTable): PyTorch's Python-key fallback hands
 * each op to the interpreter of the top mode, so a lane pushed right above the tracer's TracingMode receives every
 * op that mode would, as the dispatcher's boxed stack, without a Python call. For each op it
 *  - passes the op down (to the mode below, by that mode's own interpreter: PyTorch's Python path, as without the
 *    lane) when it is not installed, when the mode right below it is not a TracingMode, or when a tensor argument
 *    has the Python key (a subclass);
 *  - else converts the arguments to Python as PyTorch's interpreter does (positional ones up to the first
 *    keyword-only one, trailing defaults dropped; keyword-only ones that differ from their default as keywords)
 *    and hands them, with both modes off, to the tracer's C core (a `_ctracer.Dispatch` made with `runner`): the
 *    core makes the op's events as it does under the TracingMode and runs the op through `runner`, which calls it
 *    on the boxed stack (its outputs stay there: they are converted to Python once, for the core, and never back).
 *    Where the core declines (its fallback, `declined`, returns the sentinel; the core declines before it touches
 *    the tracer's state), the op is passed down to the TracingMode.
 * An error of the op itself is rethrown as it was raised (the program sees the same exception as without the
 * lane).
 *
 * Python code that reads or pops the mode stack must never meet the lane (PyTorch asserts that a mode's
 * interpreter is its own): `hide()` takes the lane off the calling thread's stack, `reconcile()` puts it right
 * above the topmost TracingMode there (or nowhere, or nowhere at all while not installed); streamsan wraps
 * PyTorch's mode-stack functions with the two (streamsan/tracers/torch/lane.py).
 */
#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <atomic>
#include <exception>
#include <memory>
#include <vector>

#include "interpreter.h"

namespace {

using Mode = std::shared_ptr<c10::impl::PyObject_TorchDispatchMode>;
using ModeTLS = c10::impl::TorchDispatchModeTLS;
using c10::DispatchKey;
using c10::DispatchKeySet;

/* Set and read with the GIL held. */
PyObject* g_core = nullptr;       // the core's Dispatch made for the lane; null: not installed
PyObject* g_mode_type = nullptr;  // the TracingMode class
PyObject* g_declined = nullptr;   // what `declined` returns
PyObject* g_token = nullptr;      // the object the lane's mode entries hold (kept for the process)
PyObject* g_no_types = nullptr;   // ()
std::atomic<uint64_t> g_handled{0}, g_passed{0};

/* The op the lane is handing to the core on this thread, for `runner`. */
struct LaneCall {
  const c10::OperatorHandle* op;
  torch::jit::Stack* stack;
  bool ran;
  std::exception_ptr error;
};
thread_local LaneCall* t_call = nullptr;

struct LaneVTable : public streamsan::StubVTable {
  std::string name() const { return "<streamsan dispatch lane>"; }
  void dispatch(const c10::OperatorHandle& op, torch::jit::Stack* stack) const;
  // (PyTorch's shallow copy of a tensor asks the top mode's interpreter for aten::detach while a mode is on)
  c10::intrusive_ptr<c10::TensorImpl> detach(const c10::TensorImpl* self) const;
  // (PyTorch runs an op's Python kernel through the top mode's interpreter: CPython's, as without the lane; every
  // spelling of a torch version is forwarded where this torch has it)
  void python_op_registration_trampoline(const c10::OperatorHandle& op, DispatchKey key, DispatchKeySet keys,
                                         torch::jit::Stack* stack, bool with_keyset, bool with_op) const {
    trampoline(0, op, key, keys, stack, with_keyset, with_op);
  }
  void python_op_registration_trampoline(const c10::OperatorHandle& op, DispatchKey key, DispatchKeySet keys,
                                         torch::jit::Stack* stack, bool with_keyset) const {
    trampoline(0, op, key, keys, stack, with_keyset);
  }
  void python_op_registration_trampoline(const c10::OperatorHandle& op, DispatchKey key,
                                         torch::jit::Stack* stack) const {
    trampoline(0, op, key, stack);
  }

 private:
  template <class... A>
  static auto trampoline(int, A&&... a)
      -> decltype((*getPyInterpreter())->python_op_registration_trampoline(std::forward<A>(a)...), void()) {
    (*getPyInterpreter())->python_op_registration_trampoline(std::forward<A>(a)...);
  }
  template <class... A>
  static void trampoline(long, A&&...) {
    unused("python_op_registration_trampoline");
  }
};

c10::impl::PyInterpreter* lane_interpreter() { return streamsan::interpreter_of<LaneVTable>(); }

bool is_lane(const Mode& m) { return &m->pyinterpreter() == lane_interpreter(); }

/* Whether a mode entry is a TracingMode (GIL held). */
bool is_tracing_mode(const Mode& m) {
  if (g_mode_type == nullptr || is_lane(m) || &m->pyinterpreter() != getPyInterpreter()) return false;
  return PyObject_TypeCheck(m->ptr(getPyInterpreter()), reinterpret_cast<PyTypeObject*>(g_mode_type));
}

/* The number of modes on this thread's user (non-infra) stack: they are the stack's first entries. */
int64_t user_modes() {
  int64_t infra = 0;
  for (int k = 0; k < static_cast<int>(c10::impl::TorchDispatchModeKey::NUM_MODE_KEYS); k++) {
    if (ModeTLS::get_mode(static_cast<c10::impl::TorchDispatchModeKey>(k)).has_value()) infra++;
  }
  return ModeTLS::stack_len() - infra;
}

/* Takes every lane entry off this thread's user stack; whether there was one. */
bool hide_lane() {
  int64_t n = user_modes();
  int64_t lowest = -1;
  for (int64_t i = 0; i < n; i++) {
    if (is_lane(ModeTLS::get_stack_at(i))) {
      lowest = i;
      break;
    }
  }
  if (lowest < 0) return false;
  std::vector<Mode> above;  // popped from the top down to the lowest lane
  for (int64_t i = n - 1; i >= lowest; i--) above.push_back(ModeTLS::pop_stack());
  for (auto it = above.rbegin(); it != above.rend(); ++it) {
    if (!is_lane(*it)) ModeTLS::push_non_infra_mode_onto_stack(*it);
  }
  return true;
}

/* Puts the lane right above the topmost TracingMode of this thread's user stack (while installed). */
void place_lane() {
  hide_lane();
  if (g_core == nullptr) return;
  int64_t n = user_modes();
  int64_t at = -1;
  for (int64_t i = n - 1; i >= 0; i--) {
    if (is_tracing_mode(ModeTLS::get_stack_at(i))) {
      at = i;
      break;
    }
  }
  if (at < 0) return;
  std::vector<Mode> above;
  for (int64_t i = n - 1; i > at; i--) above.push_back(ModeTLS::pop_stack());
  ModeTLS::push_non_infra_mode_onto_stack(std::make_shared<c10::impl::PyObject_TorchDispatchMode>(
      g_token, lane_interpreter()));
  for (auto it = above.rbegin(); it != above.rend(); ++it) ModeTLS::push_non_infra_mode_onto_stack(*it);
}

/* Pushes a popped mode back when it goes out of scope (whatever the op did). */
struct PushBack {
  Mode mode;
  explicit PushBack(Mode m) : mode(std::move(m)) {}
  void now() {
    if (mode) ModeTLS::push_non_infra_mode_onto_stack(std::move(mode));
    mode.reset();
  }
  ~PushBack() { now(); }
};

struct Gil {
  PyGILState_STATE state = PyGILState_Ensure();
  ~Gil() { PyGILState_Release(state); }
};

struct NoGil {
  PyThreadState* state = PyEval_SaveThread();
  ~NoGil() { PyEval_RestoreThread(state); }
};

/* The op, below the lane: to the mode now on top by its own interpreter, else through the dispatcher (the keys
 * above Python stay excluded, as PyTorch's fallback left them). */
void pass_down(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  g_passed.fetch_add(1, std::memory_order_relaxed);
  int64_t n = ModeTLS::stack_len();
  if (n > 0) {
    ModeTLS::get_stack_at(n - 1)->pyinterpreter()->dispatch(op, stack);
    return;
  }
  NoGil released;
  op.callBoxed(stack);
}

bool has_python_key(const c10::IValue* args, size_t n) {
  auto python = [](const c10::IValue& v) {
    return v.isTensor() && v.unsafeToTensorImpl()->key_set().has(DispatchKey::Python);
  };
  for (size_t i = 0; i < n; i++) {
    const auto& v = args[i];
    if (python(v)) return true;
    if (v.isList()) {
      for (const auto& item : v.toListRef()) {
        if (python(item)) return true;
      }
    }
  }
  return false;
}

bool kind_is(const c10::Argument& arg, c10::TypeKind kind) {
  const auto& t = arg.real_type();
  if (t->kind() == kind) return true;
  auto opt = t->cast<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == kind;
}

/* One argument as PyTorch's interpreter gives it to a mode (a new reference), or null (and no Python error) for
 * what the lane leaves to the mode: a memory format. */
PyObject* argument_to_python(const c10::Argument& arg, const c10::IValue& v) {
  if (v.isNone()) return Py_NewRef(Py_None);
  if (kind_is(arg, c10::ScalarTypeType::Kind))
    return Py_NewRef(reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt()))));
  if (kind_is(arg, c10::LayoutType::Kind))
    return Py_NewRef(reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(v.toInt()))));
  if (kind_is(arg, c10::MemoryFormatType::Kind)) return nullptr;
  return torch::jit::toPyObject(v).release().ptr();
}

/* The op's arguments as PyTorch's interpreter gives them to a mode: *args (a tuple) and *kwargs (a dict, or null
 * when there are none); false (nothing made) where the lane leaves the op to the mode. Python errors propagate
 * as C++ exceptions (pybind's). */
bool arguments_to_python(const c10::OperatorHandle& op, const c10::IValue* values, PyObject** args,
                         PyObject** kwargs) {
  const auto& schema = op.schema().arguments();
  const size_t n = schema.size();
  auto is_default = [&](size_t i) {
    const auto& d = schema[i].default_value();
    return d.has_value() && *d == values[i];
  };
  size_t keywords = n;
  while (keywords > 0 && schema[keywords - 1].kwarg_only()) keywords--;
  size_t positional = keywords;
  while (positional > 0 && is_default(positional - 1)) positional--;
  PyObject* a = PyTuple_New(static_cast<Py_ssize_t>(positional));
  if (a == nullptr) throw pybind11::error_already_set();
  PyObject* kw = nullptr;
  auto fail = [&]() {
    Py_DECREF(a);
    Py_XDECREF(kw);
  };
  try {
    for (size_t i = 0; i < positional; i++) {
      PyObject* v = argument_to_python(schema[i], values[i]);
      if (v == nullptr) {
        fail();
        return false;
      }
      PyTuple_SET_ITEM(a, static_cast<Py_ssize_t>(i), v);
    }
    for (size_t i = keywords; i < n; i++) {
      if (is_default(i)) continue;
      PyObject* v = argument_to_python(schema[i], values[i]);
      if (v == nullptr) {
        fail();
        return false;
      }
      if (kw == nullptr && (kw = PyDict_New()) == nullptr) {
        Py_DECREF(v);
        throw pybind11::error_already_set();
      }
      int rc = PyDict_SetItemString(kw, schema[i].name().c_str(), v);
      Py_DECREF(v);
      if (rc < 0) throw pybind11::error_already_set();
    }
  } catch (...) {
    fail();
    throw;
  }
  *args = a;
  *kwargs = kw;
  return true;
}

/* The op's outputs on the stack as the op's Python call returns them (a new reference). */
PyObject* outputs_to_python(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const size_t n = op.schema().returns().size();
  if (n == 0) return Py_NewRef(Py_None);
  if (n == 1) return torch::jit::toPyObject(stack.back()).release().ptr();
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(n));
  if (out == nullptr) return nullptr;
  for (size_t k = 0; k < n; k++) {
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(k),
                     torch::jit::toPyObject(stack[stack.size() - n + k]).release().ptr());
  }
  return out;
}

void LaneVTable::dispatch(const c10::OperatorHandle& op, torch::jit::Stack* stack) const {
  Gil gil;
  int64_t n = user_modes();
  if (n == 0 || !is_lane(ModeTLS::get_stack_at(n - 1))) {  // (not ours to pop: PyTorch gave it to the top one)
    pass_down(op, stack);
    return;
  }
  PushBack lane(ModeTLS::pop_stack());
  n--;
  const size_t nargs = op.schema().arguments().size();
  const c10::IValue* values = stack->data() + stack->size() - nargs;
  if (g_core == nullptr || n == 0 || !is_tracing_mode(ModeTLS::get_stack_at(n - 1)) ||
      has_python_key(values, nargs)) {
    pass_down(op, stack);
    return;
  }
  PyObject *args = nullptr, *kwargs = nullptr;
  bool converted;
  try {
    converted = arguments_to_python(op, values, &args, &kwargs);
  } catch (...) {  // (an argument PyTorch's converter does not know: the mode's)
    PyErr_Clear();
    converted = false;
  }
  if (!converted) {
    pass_down(op, stack);
    return;
  }
  PyObject* func = torch::detail::getTorchApiFunction(op).ptr();
  PyObject* core = Py_NewRef(g_core);
  PyObject* result;
  LaneCall call{&op, stack, false, nullptr};
  {
    PushBack mode(ModeTLS::pop_stack());  // the TracingMode: off while the core works, as in its own handler
    LaneCall* outer = t_call;
    t_call = &call;
    PyObject* argv[4] = {func, g_no_types, args, kwargs};
    result = PyObject_Vectorcall(core, argv, kwargs != nullptr ? 4 : 3, nullptr);
    t_call = outer;
  }
  Py_DECREF(core);
  Py_DECREF(args);
  Py_XDECREF(kwargs);
  if (result == g_declined) {
    Py_DECREF(result);
    pass_down(op, stack);
    return;
  }
  g_handled.fetch_add(1, std::memory_order_relaxed);
  if (result == nullptr) {
    if (call.error) {  // the op's own error, as it was raised
      PyErr_Clear();
      std::rethrow_exception(call.error);
    }
    if (!call.ran) throw pybind11::error_already_set();
    PyErr_Clear();  // (the core's own trouble after the op ran: the core has said so)
    return;
  }
  Py_DECREF(result);
  if (!call.ran) {  // (the core returned without running the op: run it, untraced)
    NoGil released;
    op.callBoxed(stack);
  }
}

/* A shallow copy's aten::detach: the mode below the lane's, as without the lane. */
c10::intrusive_ptr<c10::TensorImpl> LaneVTable::detach(const c10::TensorImpl* self) const {
  int64_t n = user_modes();
  TORCH_CHECK(n > 0 && is_lane(ModeTLS::get_stack_at(n - 1)) && ModeTLS::stack_len() > 1,
              "streamsan's dispatch lane was asked for a detach with no mode below it");
  PushBack lane(ModeTLS::pop_stack());
  return ModeTLS::get_stack_at(ModeTLS::stack_len() - 1)->pyinterpreter()->detach(self);
}

/* ------------------------------------------------------------------ the Python functions */
PyObject* py_run(PyObject*, PyObject*) {
  LaneCall* call = t_call;
  if (call == nullptr || call->ran) {
    PyErr_SetString(PyExc_RuntimeError, "streamsan's dispatch lane runs an op only inside its own dispatch");
    return nullptr;
  }
  call->ran = true;
  {
    NoGil released;
    try {
      call->op->callBoxed(call->stack);
    } catch (python_error& e) {  // (a Python error below: kept in the exception, out of this thread's state)
      e.persist();
      call->error = std::current_exception();
    } catch (...) {
      call->error = std::current_exception();
    }
  }
  if (call->error) {
    PyErr_SetString(PyExc_RuntimeError, "the op raised (rethrown by the dispatch lane)");
    return nullptr;
  }
  try {
    return outputs_to_python(*call->op, *call->stack);
  } catch (pybind11::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyObject* py_declined(PyObject*, PyObject* const*, Py_ssize_t) { return Py_NewRef(g_declined); }

PyObject* py_install(PyObject*, PyObject* args) {
  PyObject *core, *mode_type;
  if (!PyArg_ParseTuple(args, "OO!", &core, &PyType_Type, &mode_type)) return nullptr;
  if (lane_interpreter() == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "this torch's PyInterpreterVTable has methods the lane does not know");
    return nullptr;
  }
  Py_XSETREF(g_core, Py_NewRef(core));
  Py_XSETREF(g_mode_type, Py_NewRef(mode_type));
  place_lane();
  Py_RETURN_NONE;
}

PyObject* py_uninstall(PyObject*, PyObject*) {
  Py_CLEAR(g_core);
  hide_lane();
  Py_RETURN_NONE;
}

PyObject* py_hide(PyObject*, PyObject*) { return PyBool_FromLong(hide_lane()); }

PyObject* py_reconcile(PyObject*, PyObject*) {
  place_lane();
  Py_RETURN_NONE;
}

PyObject* py_lane_modes(PyObject*, PyObject*) {
  int64_t n = user_modes();
  PyObject* out = PyList_New(0);
  for (int64_t i = 0; out != nullptr && i < n; i++) {
    PyObject* v = PyBool_FromLong(is_lane(ModeTLS::get_stack_at(i)));
    if (PyList_Append(out, v) < 0) Py_CLEAR(out);
    Py_DECREF(v);
  }
  return out;
}

PyObject* py_counts(PyObject*, PyObject*) {
  return Py_BuildValue("(KK)", static_cast<unsigned long long>(g_handled.load()),
                       static_cast<unsigned long long>(g_passed.load()));
}

PyMethodDef lane_methods[] = {
    {"lane_install", py_install, METH_VARARGS,
     "lane_install(core, TracingMode): route the tracer's ops through `core` (a _ctracer.Dispatch made with "
     "lane_runner and lane_declined), the lane right above this thread's topmost TracingMode"},
    {"lane_uninstall", py_uninstall, METH_NOARGS,
     "lane_uninstall(): no more lane (this thread's entry goes now, other threads' pass ops down and go when "
     "hidden)"},
    {"lane_hide", py_hide, METH_NOARGS, "lane_hide() -> bool: take the lane off this thread's mode stack"},
    {"lane_reconcile", py_reconcile, METH_NOARGS,
     "lane_reconcile(): the lane right above this thread's topmost TracingMode (while installed), else nowhere"},
    {"lane_modes", py_lane_modes, METH_NOARGS,
     "lane_modes() -> [bool]: for each mode of this thread's user stack, bottom first, whether it is the lane"},
    {"lane_counts", py_counts, METH_NOARGS, "lane_counts() -> (ops handed to the core, ops passed down)"},
    {nullptr, nullptr, 0, nullptr}};

PyMethodDef run_def = {"lane_runner", py_run, METH_NOARGS,
                       "lane_runner(): run the op the lane is handing to the core (only there)"};
PyMethodDef declined_def = {"lane_declined", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(py_declined)),
                            METH_FASTCALL, "lane_declined(*args): the core's fallback for the lane: a sentinel"};

}  // namespace

/* Adds the lane's functions, `lane_runner`, `lane_declined` and `LANE_DECLINED` to the observer's module. */
int add_lane(PyObject* module) {
  if (g_declined == nullptr) {
    g_declined = PyObject_CallNoArgs(reinterpret_cast<PyObject*>(&PyBaseObject_Type));
    g_token = PyObject_CallNoArgs(reinterpret_cast<PyObject*>(&PyBaseObject_Type));
    g_no_types = PyTuple_New(0);
    if (g_declined == nullptr || g_token == nullptr || g_no_types == nullptr) return -1;
  }
  PyObject* run = PyCFunction_New(&run_def, nullptr);
  PyObject* declined = PyCFunction_New(&declined_def, nullptr);
  if (run == nullptr || declined == nullptr || PyModule_AddObject(module, "lane_runner", run) < 0 ||
      PyModule_AddObject(module, "lane_declined", declined) < 0 ||
      PyModule_AddObject(module, "LANE_DECLINED", Py_NewRef(g_declined)) < 0 ||
      PyModule_AddFunctions(module, lane_methods) < 0 ||
      PyModule_AddIntConstant(module, "LANE", lane_interpreter() != nullptr) < 0)
    return -1;
  return 0;
}
