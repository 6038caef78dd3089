/* streamsan's native observer: the ops a TorchDispatchMode pushed at start() would see, and PyTorch's GPU-trace
 * events, recorded in C++ without calling into Python.
 *
 * Ops: a thread-local RecordFunction callback (it travels with at::ThreadLocalState as a dispatch mode does: the
 * autograd engine and at::launch restore it on their threads; a new Python thread is armed by arm_thread()). It
 * fires at every Dispatcher::call / callBoxed, and keeps one record for each call that a mode pushed at start()
 * would be handed, by replaying the dispatcher's key walk from the call's tensors and the thread's included and
 * excluded keys (see `walk`): a call whose walk reaches the Python key is the mode's; the calls made below it (in
 * the mode's own handling) are hidden, those its autograd kernel makes around passing it on are ops of their own.
 * A call that a kernel above the Python key takes for good (CompositeImplicitAutograd outside inference mode, a
 * hand-written kernel that does not pass it on) is not recorded, the calls it makes are candidates. One that an
 * autocast kernel, a transform (functorch, functionalization, JIT tracing, the Python dispatcher, lazy
 * conjugation) or a mode pushed after start() takes first is recorded, marked as not the mode's view, and the calls
 * inside it are recorded as its children under the same rule.
 * A record holds: sequence number, thread (threading.get_ident()), op, flags, each tensor argument's and output's
 * storage pointer, byte offset, sizes, strides, dtype and device (copied: nothing is kept alive), the current
 * stream of the op's device, and a call site: the innermost Python frames' (code, instruction offset), interned.
 *
 * GPU trace: a C++ PyInterpreter installed in PyTorch's GPU-trace slot (the first one registered owns it) records
 * allocations, frees, event creation/record/wait/synchronize/deletion, stream creation and stream/device
 * synchronizations, numbered by the same counter as the ops. It can forward them to PyTorch's Python callbacks.
 *
 * Records are drained as packed buffers (layout in streamsan/native/records.py, checked through LAYOUT) with the
 * op names and call sites first seen since the last drain.
 */
#include <Python.h>
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000 && !defined(STREAMSAN_PUBLIC_FRAMES_ONLY)
/* CPython 3.11's and 3.12's frame layout: the call site is read without the GIL (the thread is inside an op, so
 * its frames cannot change under it; PyTorch's bindings release the GIL while the op runs). */
#define Py_BUILD_CORE
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#define STREAMSAN_FRAMES_WITHOUT_GIL 1
#else
#define STREAMSAN_FRAMES_WITHOUT_GIL 0
#endif
#if PY_VERSION_HEX >= 0x030D0000
#define STREAMSAN_FINALIZING() Py_IsFinalizing()
#else
#define STREAMSAN_FINALIZING() _Py_IsFinalizing()
#endif

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/PyInterpreter.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/version.h>

#include "interpreter.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

using c10::DispatchKey;
using c10::DispatchKeySet;

/* ------------------------------------------------------------------ the drained layout */
#pragma pack(push, 1)
struct RecordOut {
  uint64_t seq;     // numbered at the op's start
  uint64_t end;     // the next number when it ended: its own events are this thread's between seq and end
  uint64_t thread;  // threading.get_ident()
  uint64_t parent;  // seq of the enclosing record that is not the mode's view (0: none)
  int64_t stream;   // c10::Stream id of the current stream of the op's device
  uint32_t op;      // op table id
  uint32_t site;    // call-site id (0: no Python frame)
  uint32_t tensor_first;
  uint16_t n_inputs, n_outputs, flags;
  int8_t stream_device_type, stream_device_index;  // -1: no device with streams
};
struct TensorOut {
  uint64_t data;  // storage data pointer
  int64_t offset;  // storage offset in bytes
  uint64_t storage_nbytes;
  uint32_t dims_first;  // ndim sizes, then ndim strides, in the dims buffer
  int16_t arg;   // schema argument position; outputs -1 - k
  int16_t item;  // position in a tensor list, else -1
  int8_t dtype, device_type, device_index, layout;  // c10 ScalarType / DeviceType / Layout; -1 unknown
  uint8_t ndim, itemsize, flags, pad;
};
struct EventOut {
  uint64_t seq, thread, a, b;  // a: pointer / event; b: stream
  uint8_t kind;
  int8_t device_type, device_index;  // the current device, for allocations and device synchronizations
  uint8_t pad;
};
#pragma pack(pop)
static_assert(sizeof(RecordOut) == 60 && sizeof(TensorOut) == 40 && sizeof(EventOut) == 36, "packed layout");

constexpr const char* kLayout = "records-1:60:40:36";

// record flags
constexpr uint16_t F_AUTOCAST = 1, F_TRANSFORM = 2, F_MODE_ABOVE = 4, F_SUBCLASS = 8, F_MULTI_DEVICE = 16,
                   F_NO_OUTPUTS = 32;
// tensor flags
constexpr uint8_t T_PYTHON = 1, T_NO_STORAGE = 2, T_NO_LAYOUT = 4, T_CONJ = 8, T_NEG = 16;
// event kinds
enum : uint8_t {
  E_EVENT_CREATE = 1, E_EVENT_DELETE, E_EVENT_RECORD, E_EVENT_WAIT, E_ALLOC, E_FREE, E_STREAM_CREATE,
  E_DEVICE_SYNC, E_STREAM_SYNC, E_EVENT_SYNC
};

/* ------------------------------------------------------------------ global state */
std::atomic<uint64_t> g_seq{1};
std::atomic<bool> g_active{false};
std::atomic<int> g_frames{0};
std::atomic<int64_t> g_mode_baseline{0};  // dispatch modes pushed before start(): below the observed mode

struct SpinLock {
  std::atomic_flag flag = ATOMIC_FLAG_INIT;
  void lock() {
    while (flag.test_and_set(std::memory_order_acquire)) std::this_thread::yield();
  }
  void unlock() { flag.clear(std::memory_order_release); }
};

struct Buffer {  // one thread's finished records and events, until drained
  SpinLock lock;
  std::vector<RecordOut> records;
  std::vector<TensorOut> tensors;
  std::vector<int64_t> dims;
  std::vector<EventOut> events;
};

struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<Buffer>> buffers;
};
Registry* g_registry = new Registry;  // (never destroyed: threads may outlive static destruction)

struct OpInfo {
  uint32_t id;
  c10::OperatorHandle handle;
  size_t num_returns;
};

struct OpTable {  // every op overload met, by its schema's name and overload pointers
  std::mutex mutex;
  std::unordered_map<const void*, std::vector<std::pair<const void*, OpInfo*>>> by_name;
  std::vector<OpInfo*> all, fresh;  // fresh: met since the last drain
  uint32_t next = 1;
};
OpTable* g_ops = new OpTable;

/* ------------------------------------------------------------------ call sites */
constexpr int kMaxFrames = 64;

struct FrameKey {
  int n = 0;
  uint64_t words[2 * kMaxFrames];  // code pointer, instruction offset (bytes), innermost first
};

uint64_t hash_words(const uint64_t* w, int n) {
  uint64_t h = 1469598103934665603ull ^ static_cast<uint64_t>(n);
  for (int i = 0; i < n; i++) {
    h ^= w[i];
    h *= 1099511628211ull;
    h ^= h >> 29;
  }
  return h | 1;  // (0 marks an empty slot)
}

/* An open-addressing map from a word sequence to an id, the keys kept in one arena. */
struct KeyMap {
  struct Slot {
    uint64_t hash;
    uint32_t id, len, at;
  };
  std::vector<Slot> slots = std::vector<Slot>(256);
  std::vector<uint64_t> arena;
  size_t used = 0;

  uint32_t find(const uint64_t* w, uint32_t len, uint64_t h) const {
    size_t mask = slots.size() - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      const Slot& s = slots[i];
      if (s.hash == 0) return 0;
      if (s.hash == h && s.len == len && std::memcmp(&arena[s.at], w, len * sizeof(uint64_t)) == 0) return s.id;
    }
  }
  void insert(const uint64_t* w, uint32_t len, uint64_t h, uint32_t id) {
    if (2 * (used + 1) > slots.size()) grow();
    size_t mask = slots.size() - 1;
    size_t i = h & mask;
    while (slots[i].hash != 0) i = (i + 1) & mask;
    slots[i] = Slot{h, id, len, static_cast<uint32_t>(arena.size())};
    arena.insert(arena.end(), w, w + len);
    used++;
  }
  void grow() {
    std::vector<Slot> old(2 * slots.size());
    old.swap(slots);
    size_t mask = slots.size() - 1;
    for (const Slot& s : old) {
      if (s.hash == 0) continue;
      size_t i = s.hash & mask;
      while (slots[i].hash != 0) i = (i + 1) & mask;
      slots[i] = s;
    }
  }
};

struct SiteTable {  // every call site met; its code objects are kept alive (one reference each) for the decoder
  std::mutex mutex;
  KeyMap map;
  using Site = std::pair<uint32_t, std::vector<uint64_t>>;
  std::vector<Site> all, fresh;  // fresh: met since the last drain
  uint32_t next = 1;
};
SiteTable* g_sites = new SiteTable;

/* The calling thread's innermost Python frames (at most `depth`), into key; false when it holds none. */
bool read_frames(FrameKey& key, int depth) {
  key.n = 0;
#if STREAMSAN_FRAMES_WITHOUT_GIL
  PyThreadState* ts = PyGILState_GetThisThreadState();
  if (ts == nullptr || ts->cframe == nullptr) return false;
  for (_PyInterpreterFrame* f = ts->cframe->current_frame; f != nullptr && key.n < depth; f = f->previous) {
#if PY_VERSION_HEX >= 0x030C0000
    if (f->owner == FRAME_OWNED_BY_CSTACK) continue;  // (3.12's entry frames: no Python code of their own)
#endif
    if (f->owner != FRAME_OWNED_BY_GENERATOR &&
        f->prev_instr < _PyCode_CODE(f->f_code) + f->f_code->_co_firsttraceable)
      continue;  // (an incomplete frame, as PyEval_GetFrame skips)
    int lasti = _PyInterpreterFrame_LASTI(f);
    key.words[2 * key.n] = reinterpret_cast<uint64_t>(f->f_code);
    key.words[2 * key.n + 1] = static_cast<uint64_t>(static_cast<int64_t>(lasti < 0 ? -1 : lasti * 2));
    key.n++;
  }
#elif PY_VERSION_HEX >= 0x030B0000
  // Other Pythons: the public frame API, which needs the GIL: only where the thread already holds it.
  if (!PyGILState_Check()) return false;
  PyFrameObject* f = PyEval_GetFrame();
  Py_XINCREF(f);
  while (f != nullptr && key.n < depth) {
    PyCodeObject* code = PyFrame_GetCode(f);
    key.words[2 * key.n] = reinterpret_cast<uint64_t>(code);
    key.words[2 * key.n + 1] = static_cast<uint64_t>(static_cast<int64_t>(PyFrame_GetLasti(f)));
    Py_DECREF(code);  // (the frame keeps it alive)
    key.n++;
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
#else
  (void)depth;
#endif
  return key.n > 0;
}

/* ------------------------------------------------------------------ per-thread state */
enum Kind : uint8_t {
  K_IGNORED,  // started while the observer was off, or nested in a record the mode sees
  K_PASS,     // not the mode's (decomposed before it, or no mode could see it): the calls inside are candidates
  K_VISIBLE,  // the mode's view: recorded, the calls made below it are hidden
  K_MARKED    // recorded, not the mode's view: the calls inside are recorded as its children
};

struct Open {
  const at::RecordFunction* fn;
  Kind kind;
  uint16_t flags;
  bool calls_above;  // K_VISIBLE: its autograd kernel may make calls of its own around passing the op on
  OpInfo* op;
  uint64_t seq, parent, outer_parent;
  uint64_t included, excluded;  // the thread's dispatch keys when it began
  int outer_visible;
  uint32_t site, tensors_from, dims_from;
  uint16_t n_inputs;
  int8_t stream_device_type, stream_device_index;
  int64_t stream;
};

enum Verdict : uint8_t { V_VISIBLE = 1, V_PASS, V_AUTOCAST, V_TRANSFORM };
struct Walk {
  Verdict verdict;
  bool calls_above;
};

struct VerdictCache {  // (op name, overload, dispatch key set) -> (op, verdict)
  struct Slot {
    const void* name;
    const void* overload;
    uint64_t keys;
    OpInfo* op;
    Walk walk;
  };
  std::vector<Slot> slots = std::vector<Slot>(512);
  size_t used = 0;

  static size_t hash(const void* n, uint64_t k) {
    uint64_t h = reinterpret_cast<uint64_t>(n) * 0x9E3779B97F4A7C15ull ^ k * 0xC2B2AE3D27D4EB4Full;
    return static_cast<size_t>(h ^ (h >> 31));
  }
  const Slot* find(const void* n, const void* o, uint64_t k) const {
    size_t mask = slots.size() - 1;
    for (size_t i = hash(n, k) & mask;; i = (i + 1) & mask) {
      const Slot& s = slots[i];
      if (s.name == nullptr) return nullptr;
      if (s.name == n && s.overload == o && s.keys == k) return &s;
    }
  }
  void insert(const Slot& slot) {
    if (2 * (used + 1) > slots.size()) {
      std::vector<Slot> old(2 * slots.size());
      old.swap(slots);
      for (const Slot& s : old)
        if (s.name != nullptr) place(s);
    }
    place(slot);
    used++;
  }
  void place(const Slot& slot) {
    size_t mask = slots.size() - 1;
    size_t i = hash(slot.name, slot.keys) & mask;
    while (slots[i].name != nullptr) i = (i + 1) & mask;
    slots[i] = slot;
  }
};

struct ThreadState {
  std::shared_ptr<Buffer> buffer = std::make_shared<Buffer>();
  std::vector<Open> stack;
  int visible = -1;     // the innermost open record of the mode's view (its index in the stack)
  uint64_t parent = 0;  // the innermost open record that is not the mode's view
  std::vector<TensorOut> tensors;  // the open records' tensors, innermost last
  std::vector<int64_t> dims;
  VerdictCache verdicts;
  KeyMap sites;
  FrameKey frames;
  at::CallbackHandle handle = 0;  // this thread's own registration of the callback
  uint64_t ident = PyThread_get_thread_ident();

  ThreadState() {
    std::lock_guard<std::mutex> g(g_registry->mutex);
    g_registry->buffers.push_back(buffer);
  }
};

thread_local ThreadState* t_state = nullptr;
thread_local bool t_gone = false;  // the thread's state was destroyed (thread or process exit)

struct ThreadStateOwner {
  ~ThreadStateOwner() {
    t_gone = true;
    delete t_state;
    t_state = nullptr;
  }
};
thread_local ThreadStateOwner t_owner;

ThreadState* this_thread() {
  if (C10_LIKELY(t_state != nullptr)) return t_state;
  if (t_gone) return nullptr;
  (void)&t_owner;  // (constructs the owner, whose destructor frees the state)
  t_state = new ThreadState;
  return t_state;
}

/* ------------------------------------------------------------------ the visibility rule */

/* Whether the kernel at autograd key k is the op's CompositeImplicitAutograd kernel (the op decomposes there),
 * by the dispatcher's own precedence (OperatorEntry::computeDispatchTableEntryWithDebug). */
bool decomposes(const c10::OperatorHandle& op, DispatchKey k) {
  if (op.hasKernelForDispatchKey(k)) return false;
  if (k == DispatchKey::AutogradNestedTensor &&
      op.hasKernelForDispatchKey(DispatchKey::CompositeImplicitAutogradNestedTensor))
    return true;
  if (!op.hasKernelForDispatchKey(DispatchKey::CompositeImplicitAutograd)) return false;
  if (k == DispatchKey::AutogradOther && op.hasKernelForAnyDispatchKey(c10::autogradother_backends)) return false;
  bool backend = op.hasKernelForAnyDispatchKey(c10::getBackendKeySetFromAutograd(k)) ||
                 op.hasKernelForDispatchKey(DispatchKey::CompositeExplicitAutograd);
  return !backend;
}

/* Whether op is the aten op `name` with its kernel at key k written by hand in VariableTypeManual.cpp, which does
 * not pass the call on to the keys below: detach_'s autograd kernel does its work itself; _fw_primal's and
 * _make_dual's ADInplaceOrView kernels call alias() anew (a call of its own, which the mode sees). */
bool own_kernel(const c10::OperatorHandle& op, DispatchKey k) {
  return op.hasKernelForDispatchKey(k) && !op.isKernelFallthroughKernel(k);
}

bool manual_kernel_stops(const c10::OperatorHandle& op, DispatchKey k, const char* const* names) {
  const auto& name = op.operator_name();
  if (!name.overload_name.empty()) return false;
  for (const char* const* n = names; *n != nullptr; n++)
    if (name.name == *n) return op.hasKernelForDispatchKey(k);
  return false;
}
const char* const kAutogradStops[] = {"aten::detach_", nullptr};
const char* const kInplaceOrViewStops[] = {"aten::_fw_primal", "aten::_make_dual", nullptr};

/* What a mode would make of a call with dispatch keys ks (Python included as a mode includes it): walk the keys
 * above Python from the highest, as the dispatcher would. */
Walk walk(const c10::OperatorHandle& op, DispatchKeySet ks) {
  bool calls_above = false;
  if (!ks.has(DispatchKey::Python)) return {V_PASS, false};  // Python excluded here: no mode is called
  for (int guard = 0; guard < 128; guard++) {
    DispatchKey k = ks.highestPriorityTypeId();
    DispatchKey f = c10::toFunctionalityKey(k);
    if (f == DispatchKey::Python) return {V_VISIBLE, calls_above};
    if (f == DispatchKey::Undefined) return {V_PASS, false};
    if (f == DispatchKey::PythonTLSSnapshot) {
      // its kernel redispatches to the keys below, unchanged
    } else if (f == DispatchKey::ADInplaceOrView) {
      if (manual_kernel_stops(op, DispatchKey::ADInplaceOrView, kInplaceOrViewStops)) return {V_PASS, false};
    } else if (c10::autograd_dispatch_keyset.has(f)) {
      if (decomposes(op, k) || manual_kernel_stops(op, DispatchKey::Autograd, kAutogradStops)) return {V_PASS, false};
      // A kernel of the op's own here (generated or Python) runs code around passing the op on; the autograd
      // fallback makes no call of its own.
      calls_above = calls_above || own_kernel(op, k) || own_kernel(op, DispatchKey::Autograd);
    } else if (c10::autocast_dispatch_keyset.has(f)) {
      if (own_kernel(op, k)) return {V_AUTOCAST, false};
    } else if (f == DispatchKey::Conjugate || f == DispatchKey::Negative || f == DispatchKey::ZeroTensor) {
      if (!(op.hasKernelForDispatchKey(k) && op.isKernelFallthroughKernel(k))) return {V_TRANSFORM, false};
    } else {
      return {V_TRANSFORM, false};
    }
    ks = ks & DispatchKeySet(DispatchKeySet::FULL_AFTER, f);
  }
  return {V_TRANSFORM, false};
}

/* The op of a record and the walk for its keys, computed once per (op, keys) and cached by the thread; nullptr
 * for a record that names no op (a RECORD_FUNCTION scope). */
const VerdictCache::Slot* resolve(ThreadState* ts, const at::RecordFunction& fn, uint64_t keys) {
  const char* name = fn.name();
  const char* overload = fn.overload_name();
  const VerdictCache::Slot* hit = ts->verdicts.find(name, overload, keys);
  if (hit != nullptr) return hit;
  auto opname = fn.operator_name();
  if (!opname.has_value()) return nullptr;  // (not cached: such a name's storage is the record's own)
  OpInfo* info = nullptr;
  Walk w;
  {
    std::lock_guard<std::mutex> g(g_ops->mutex);
    for (auto& e : g_ops->by_name[name])
      if (e.first == overload) info = e.second;
    if (info == nullptr) {
      auto handle = c10::Dispatcher::singleton().findOp(*opname);
      if (!handle.has_value()) return nullptr;
      info = new OpInfo{g_ops->next++, *handle, handle->hasSchema() ? handle->schema().returns().size() : 0};
      g_ops->by_name[name].emplace_back(overload, info);
      g_ops->all.push_back(info);
      g_ops->fresh.push_back(info);
    }
    w = walk(info->handle, DispatchKeySet(DispatchKeySet::RAW, keys));
  }
  ts->verdicts.insert(VerdictCache::Slot{name, overload, keys, info, w});
  return ts->verdicts.find(name, overload, keys);
}

/* ------------------------------------------------------------------ tensors */
void add_keys(const c10::IValue& v, DispatchKeySet& ks, int depth = 0) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined()) ks = ks | t.unsafeGetTensorImpl()->key_set();
  } else if (v.isList() && depth < 2) {
    for (const c10::IValue& e : v.toListRef()) add_keys(e, ks, depth + 1);
  }
}

void describe(ThreadState* ts, const c10::TensorImpl* impl, int arg, int item) {
  if (impl->is_wrapped_number()) return;  // (a Python number to the mode)
  TensorOut o{};
  o.arg = static_cast<int16_t>(arg);
  o.item = static_cast<int16_t>(item);
  o.dtype = static_cast<int8_t>(impl->dtype().toScalarType());
  o.itemsize = static_cast<uint8_t>(impl->itemsize());
  bool python = impl->key_set().has(DispatchKey::Python);
  uint8_t flags = python ? T_PYTHON : 0;
  if (impl->is_conj()) flags |= T_CONJ;
  if (impl->is_neg()) flags |= T_NEG;
  o.dims_first = static_cast<uint32_t>(ts->dims.size());
  o.device_type = o.device_index = o.layout = -1;
  if (python) {
    // A subclass may answer its device, layout, sizes and strides in Python: none is asked (its op is the
    // Python path's); its storage's device is its own.
    flags |= T_NO_LAYOUT;
    if (impl->has_storage()) {
      c10::Device d = impl->unsafe_storage().device();
      o.device_type = static_cast<int8_t>(d.type());
      o.device_index = static_cast<int8_t>(d.index());
    }
  } else {
    c10::Device d = impl->device();
    o.device_type = static_cast<int8_t>(d.type());
    o.device_index = static_cast<int8_t>(d.index());
    o.layout = static_cast<int8_t>(impl->layout());
    if (impl->has_symbolic_sizes_strides()) {
      flags |= T_NO_LAYOUT;
    } else {
      try {  // (sparse and nested tensors have no strides: they throw)
        auto sizes = impl->sizes();
        auto strides = impl->strides();
        int64_t offset = impl->storage_offset();
        o.ndim = static_cast<uint8_t>(sizes.size());
        ts->dims.insert(ts->dims.end(), sizes.begin(), sizes.end());
        ts->dims.insert(ts->dims.end(), strides.begin(), strides.end());
        o.offset = offset * static_cast<int64_t>(o.itemsize);
      } catch (...) {
        ts->dims.resize(o.dims_first);
        o.ndim = 0;
        flags |= T_NO_LAYOUT;
      }
    }
  }
  if (impl->has_storage()) {
    c10::StorageImpl* st = impl->unsafe_storage().unsafeGetStorageImpl();
    if (st != nullptr) {
      try {
        o.data = reinterpret_cast<uint64_t>(st->data_ptr().get());
        o.storage_nbytes = st->nbytes();
      } catch (...) {
        flags |= T_NO_STORAGE;  // (fake and functional storages, symbolic sizes)
      }
    } else {
      flags |= T_NO_STORAGE;
    }
  } else {
    flags |= T_NO_STORAGE;
  }
  o.flags = flags;
  ts->tensors.push_back(o);
}

void add_tensors(ThreadState* ts, const c10::IValue& v, int arg) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined()) describe(ts, t.unsafeGetTensorImpl(), arg, -1);
  } else if (v.isList()) {
    int item = 0;
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor()) {
        const at::Tensor& t = e.toTensor();
        if (t.defined()) describe(ts, t.unsafeGetTensorImpl(), arg, item);
        item++;
      } else if (e.isList()) {  // Tensor[][]: flattened
        for (const c10::IValue& x : e.toListRef()) {
          if (x.isTensor() && x.toTensor().defined()) describe(ts, x.toTensor().unsafeGetTensorImpl(), arg, item);
          item++;
        }
      } else {
        item++;  // (None in Tensor?[])
      }
    }
  }
}

/* The current stream of the first device with streams among tensors [from, to). */
bool stream_of(ThreadState* ts, size_t from, size_t to, Open& o) {
  for (size_t i = from; i < to; i++) {
    const TensorOut& t = ts->tensors[i];
    if (t.device_type < 0) continue;
    auto type = static_cast<c10::DeviceType>(t.device_type);
    if (type == c10::DeviceType::CPU || type == c10::DeviceType::Meta) continue;
    if (!c10::impl::hasDeviceGuardImpl(type)) continue;
    c10::Stream s = c10::impl::getDeviceGuardImpl(type)->getStream(c10::Device(type, t.device_index));
    o.stream = s.id();
    o.stream_device_type = t.device_type;
    o.stream_device_index = t.device_index;
    return true;
  }
  return false;
}

bool several_devices(ThreadState* ts, size_t from, size_t to) {
  int8_t type = -1, index = -1;
  for (size_t i = from; i < to; i++) {
    const TensorOut& t = ts->tensors[i];
    if (t.device_type < 0 || t.device_type == static_cast<int8_t>(c10::DeviceType::CPU)) continue;
    if (type < 0) {
      type = t.device_type;
      index = t.device_index;
    } else if (t.device_type != type || t.device_index != index) {
      return true;
    }
  }
  return false;
}

/* ------------------------------------------------------------------ call sites */
void keep_codes(const std::vector<uint64_t>& words) {
  for (size_t i = 0; i < words.size(); i += 2) Py_INCREF(reinterpret_cast<PyObject*>(words[i]));
}

uint32_t site_of(ThreadState* ts) {
  int depth = g_frames.load(std::memory_order_relaxed);
  FrameKey& key = ts->frames;
  if (depth <= 0 || !read_frames(key, depth)) return 0;
  uint32_t len = static_cast<uint32_t>(2 * key.n);
  uint64_t h = hash_words(key.words, static_cast<int>(len));
  uint32_t id = ts->sites.find(key.words, len, h);
  if (id != 0) return id;
  {
    std::lock_guard<std::mutex> g(g_sites->mutex);
    id = g_sites->map.find(key.words, len, h);
  }
  if (id == 0) {
    // A new site: its code objects get a reference, under the GIL (taken before the table's lock, the order
    // drain() takes them in).
    if (!Py_IsInitialized() || STREAMSAN_FINALIZING()) return 0;
    bool held = PyGILState_Check();
    PyGILState_STATE gil{};
    if (!held) gil = PyGILState_Ensure();
    {
      std::lock_guard<std::mutex> g(g_sites->mutex);
      id = g_sites->map.find(key.words, len, h);
      if (id == 0) {
        id = g_sites->next++;
        g_sites->map.insert(key.words, len, h, id);
        std::vector<uint64_t> words(key.words, key.words + len);
        keep_codes(words);
        g_sites->all.emplace_back(id, words);
        g_sites->fresh.emplace_back(id, std::move(words));
      }
    }
    if (!held) PyGILState_Release(gil);
  }
  ts->sites.insert(key.words, len, h, id);
  return id;
}

/* ------------------------------------------------------------------ the callback */
void disarm_stale(ThreadState* ts) {
  if (ts->handle != 0) {  // the observer stopped: this thread's registration goes (only it can remove it)
    at::removeCallback(ts->handle);
    ts->handle = 0;
  }
}

void begin(ThreadState* ts, const at::RecordFunction& fn, OpInfo* op, Kind kind, uint16_t flags, bool calls_above,
           const c10::impl::LocalDispatchKeySet& local) {
  Open o{};
  o.fn = &fn;
  o.kind = kind;
  o.flags = flags;
  o.calls_above = calls_above;
  o.included = local.included_.raw_repr();
  o.excluded = local.excluded_.raw_repr();
  o.outer_visible = ts->visible;
  o.op = op;
  o.seq = g_seq.fetch_add(1, std::memory_order_relaxed);
  o.parent = ts->parent;
  o.outer_parent = ts->parent;
  o.tensors_from = static_cast<uint32_t>(ts->tensors.size());
  o.dims_from = static_cast<uint32_t>(ts->dims.size());
  o.stream_device_type = -1;
  o.stream_device_index = -1;
  try {
    auto inputs = fn.inputs();
    for (size_t i = 0; i < inputs.size(); i++) add_tensors(ts, inputs[i], static_cast<int>(i));
    o.n_inputs = static_cast<uint16_t>(ts->tensors.size() - o.tensors_from);
    stream_of(ts, o.tensors_from, ts->tensors.size(), o);
    o.site = site_of(ts);
    ts->stack.reserve(ts->stack.size() + 1);
  } catch (...) {
    ts->tensors.resize(o.tensors_from);
    ts->dims.resize(o.dims_from);
    throw;
  }
  if (kind == K_VISIBLE) {
    ts->visible = static_cast<int>(ts->stack.size());
  } else {
    ts->parent = o.seq;
  }
  ts->stack.push_back(o);
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  ThreadState* ts = this_thread();
  if (ts == nullptr) return nullptr;
  try {
    auto local = c10::impl::tls_local_dispatch_key_set();
    if (ts->visible >= 0) {
      // Inside a call the mode is handed: what is called below it, in the mode's own handling, is hidden; what
      // its autograd kernel calls around passing it on (with the thread's keys as when it began) is the mode's
      // to see as calls of their own.
      const Open& v = ts->stack[ts->visible];
      if (!(v.calls_above && local.included_.raw_repr() == v.included && local.excluded_.raw_repr() == v.excluded)) {
        ts->stack.push_back(Open{&fn, K_IGNORED});
        return nullptr;
      }
    }
    if (!g_active.load(std::memory_order_relaxed)) {
      if (ts->stack.empty()) {
        disarm_stale(ts);
      } else {
        ts->stack.push_back(Open{&fn, K_IGNORED});
      }
      return nullptr;
    }
    DispatchKeySet tensors;
    for (const c10::IValue& v : fn.inputs()) add_keys(v, tensors);
    DispatchKeySet mode_keys{DispatchKey::Python, DispatchKey::PythonTLSSnapshot};
    DispatchKeySet keys = (tensors | local.included_ | mode_keys) - local.excluded_;
    const VerdictCache::Slot* slot = resolve(ts, fn, keys.raw_repr());
    if (slot == nullptr || slot->walk.verdict == V_PASS) {
      ts->stack.push_back(Open{&fn, K_PASS});
      return nullptr;
    }
    Kind kind = K_MARKED;
    uint16_t flags = 0;
    if (slot->walk.verdict == V_AUTOCAST) {
      flags = F_AUTOCAST;
    } else if (slot->walk.verdict == V_TRANSFORM) {
      flags = F_TRANSFORM;
    } else if (c10::impl::TorchDispatchModeTLS::stack_len() > g_mode_baseline.load(std::memory_order_relaxed)) {
      flags = F_MODE_ABOVE;
    } else {
      kind = K_VISIBLE;
    }
    if (tensors.has(DispatchKey::Python)) flags |= F_SUBCLASS;
    begin(ts, fn, slot->op, kind, flags, slot->walk.calls_above, local);
  } catch (...) {
    ts->stack.push_back(Open{&fn, K_IGNORED});
  }
  return nullptr;
}

void finish(ThreadState* ts, Open& o, const at::RecordFunction& fn) {
  if (o.kind == K_VISIBLE) {
    ts->visible = o.outer_visible;
  } else {
    ts->parent = o.outer_parent;
  }
  const auto& outputs = fn.outputs();
  try {
    for (size_t k = 0; k < outputs.size(); k++) add_tensors(ts, outputs[k], -1 - static_cast<int>(k));
  } catch (...) {  // (the record goes, the open ones below it stay whole)
    ts->tensors.resize(o.tensors_from);
    ts->dims.resize(o.dims_from);
    throw;
  }
  if (outputs.size() != o.op->num_returns) o.flags |= F_NO_OUTPUTS;
  size_t to = ts->tensors.size();
  if (o.stream_device_type < 0) stream_of(ts, o.tensors_from, to, o);
  if (several_devices(ts, o.tensors_from, to)) o.flags |= F_MULTI_DEVICE;
  RecordOut r{};
  r.seq = o.seq;
  r.end = g_seq.load(std::memory_order_relaxed);
  r.thread = ts->ident;
  r.parent = o.parent;
  r.stream = o.stream;
  r.op = o.op->id;
  r.site = o.site;
  r.n_inputs = o.n_inputs;
  r.n_outputs = static_cast<uint16_t>(to - o.tensors_from - o.n_inputs);
  r.flags = o.flags;
  r.stream_device_type = o.stream_device_type;
  r.stream_device_index = o.stream_device_index;
  Buffer& b = *ts->buffer;
  b.lock.lock();
  r.tensor_first = static_cast<uint32_t>(b.tensors.size());
  uint32_t dims_base = static_cast<uint32_t>(b.dims.size());
  b.records.push_back(r);
  for (size_t i = o.tensors_from; i < to; i++) {
    TensorOut t = ts->tensors[i];
    t.dims_first = t.dims_first - o.dims_from + dims_base;
    b.tensors.push_back(t);
  }
  b.dims.insert(b.dims.end(), ts->dims.begin() + o.dims_from, ts->dims.end());
  b.lock.unlock();
  ts->tensors.resize(o.tensors_from);
  ts->dims.resize(o.dims_from);
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  ThreadState* ts = t_state;
  if (ts == nullptr || ts->stack.empty()) return;
  try {
    size_t i = ts->stack.size();
    while (i > 0 && ts->stack[i - 1].fn != &fn) i--;
    if (i == 0) return;  // (not ours: begun before this thread was armed)
    while (ts->stack.size() > i) {  // records whose end never came (cannot happen for dispatcher calls)
      Open lost = ts->stack.back();
      ts->stack.pop_back();
      if (lost.kind == K_VISIBLE) ts->visible = lost.outer_visible;
      if (lost.kind == K_MARKED) ts->parent = lost.outer_parent;
      if (lost.kind >= K_VISIBLE) {
        ts->tensors.resize(lost.tensors_from);
        ts->dims.resize(lost.dims_from);
      }
    }
    Open o = ts->stack.back();
    ts->stack.pop_back();
    if (o.kind >= K_VISIBLE) finish(ts, o, fn);
  } catch (...) {
  }
}

bool arm_this_thread() {
  ThreadState* ts = this_thread();
  if (ts == nullptr || ts->handle != 0) return false;
  ts->handle = at::addThreadLocalCallback(at::RecordFunctionCallback(on_start, on_end)
                                              .needsInputs(true)
                                              .needsOutputs(true)
                                              .scopes({at::RecordScope::FUNCTION}));
  return true;
}

/* ------------------------------------------------------------------ GPU trace */
/* While forwarding: each event kind's registry of torch.cuda._gpu_trace (indexed by kind; null: none), resolved
 * once, and its fire_callbacks looked up at each event (whoever registers later changes it), as PyTorch's own
 * interpreter does but without its import and attribute walk per event. */
PyObject* g_registries[E_EVENT_SYNC + 1] = {};
PyObject* g_fire_callbacks = nullptr;  // the interned name
bool g_forwarding = false;
/* Set while no Python callback behind the registries wants the events (no tracer active, no one else's callback
 * registered): forwarding stops at this check, without the GIL. */
std::atomic<bool> g_quiet{false};

void forward(uint8_t kind, c10::DeviceType type, int n, uint64_t a, uint64_t b) {
  if (!g_forwarding || (type != c10::DeviceType::CUDA && type != c10::DeviceType::HIP)) return;
  if (g_quiet.load(std::memory_order_relaxed)) return;
  if (!Py_IsInitialized() || STREAMSAN_FINALIZING()) return;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* reg = g_forwarding ? g_registries[kind] : nullptr;
  if (reg != nullptr) {
    Py_INCREF(reg);
    PyObject* fire = PyObject_GetAttr(reg, g_fire_callbacks);
    PyObject* result = nullptr;
    if (fire != nullptr) {
      PyObject* args[2] = {nullptr, nullptr};
      int made = 0;
      for (; made < n; made++) {
        args[made] = PyLong_FromUnsignedLongLong(made == 0 ? a : b);
        if (args[made] == nullptr) break;
      }
      if (made == n) result = PyObject_Vectorcall(fire, args, static_cast<size_t>(n), nullptr);
      for (int i = 0; i < made; i++) Py_DECREF(args[i]);
    }
    if (result == nullptr) PyErr_WriteUnraisable(fire ? fire : reg);
    Py_XDECREF(result);
    Py_XDECREF(fire);
    Py_DECREF(reg);
  }
  PyGILState_Release(gil);
}

void trace(uint8_t kind, c10::DeviceType type, uint64_t a, uint64_t b) {
  if (!g_active.load(std::memory_order_relaxed)) return;
  ThreadState* ts = this_thread();
  if (ts == nullptr) return;
  EventOut e{};
  e.seq = g_seq.fetch_add(1, std::memory_order_relaxed);
  e.thread = ts->ident;
  e.a = a;
  e.b = b;
  e.kind = kind;
  e.device_type = static_cast<int8_t>(type);
  e.device_index = -1;
  if ((kind == E_ALLOC || kind == E_DEVICE_SYNC) && c10::impl::hasDeviceGuardImpl(type)) {
    try {
      e.device_index = static_cast<int8_t>(c10::impl::getDeviceGuardImpl(type)->getDevice().index());
    } catch (...) {
    }
  }
  Buffer& buf = *ts->buffer;
  buf.lock.lock();
  buf.events.push_back(e);
  buf.lock.unlock();
}

void event(uint8_t kind, c10::DeviceType type, int n, uint64_t a, uint64_t b) {
  trace(kind, type, a, b);
  forward(kind, type, n, a, b);
}

/* The trace slot's interpreter: its trace methods record (and forward) each event; no Python object is tagged
 * with it. */
struct TraceVTable : public streamsan::StubVTable {
  void trace_gpu_event_creation(DT t, uintptr_t e) const { event(E_EVENT_CREATE, t, 1, e, 0); }
  void trace_gpu_event_deletion(DT t, uintptr_t e) const { event(E_EVENT_DELETE, t, 1, e, 0); }
  void trace_gpu_event_record(DT t, uintptr_t e, uintptr_t s) const {
    event(E_EVENT_RECORD, t, 2, e, s);
  }
  void trace_gpu_event_wait(DT t, uintptr_t e, uintptr_t s) const { event(E_EVENT_WAIT, t, 2, e, s); }
  void trace_gpu_memory_allocation(DT t, uintptr_t p) const { event(E_ALLOC, t, 1, p, 0); }
  void trace_gpu_memory_deallocation(DT t, uintptr_t p) const {
    event(E_FREE, t, 1, p, 0);
  }
  void trace_gpu_stream_creation(DT t, uintptr_t s) const {
    event(E_STREAM_CREATE, t, 1, s, 0);
  }
  void trace_gpu_device_synchronization(DT t) const {
    event(E_DEVICE_SYNC, t, 0, 0, 0);
  }
  void trace_gpu_stream_synchronization(DT t, uintptr_t s) const {
    event(E_STREAM_SYNC, t, 1, s, 0);
  }
  void trace_gpu_event_synchronization(DT t, uintptr_t e) const {
    event(E_EVENT_SYNC, t, 1, e, 0);
  }
  // (torch versions whose trace methods name no device type: CUDA's)
  void trace_gpu_event_creation(uintptr_t e) const { trace_gpu_event_creation(DT::CUDA, e); }
  void trace_gpu_event_deletion(uintptr_t e) const { trace_gpu_event_deletion(DT::CUDA, e); }
  void trace_gpu_event_record(uintptr_t e, uintptr_t s) const { trace_gpu_event_record(DT::CUDA, e, s); }
  void trace_gpu_event_wait(uintptr_t e, uintptr_t s) const { trace_gpu_event_wait(DT::CUDA, e, s); }
  void trace_gpu_memory_allocation(uintptr_t p) const { trace_gpu_memory_allocation(DT::CUDA, p); }
  void trace_gpu_memory_deallocation(uintptr_t p) const { trace_gpu_memory_deallocation(DT::CUDA, p); }
  void trace_gpu_stream_creation(uintptr_t s) const { trace_gpu_stream_creation(DT::CUDA, s); }
  void trace_gpu_device_synchronization() const { trace_gpu_device_synchronization(DT::CUDA); }
  void trace_gpu_stream_synchronization(uintptr_t s) const { trace_gpu_stream_synchronization(DT::CUDA, s); }
  void trace_gpu_event_synchronization(uintptr_t e) const { trace_gpu_event_synchronization(DT::CUDA, e); }
};

/* ------------------------------------------------------------------ the Python module */
PyObject* py_start(PyObject*, PyObject* args) {
  int frames = 0;
  if (!PyArg_ParseTuple(args, "i", &frames)) return nullptr;
  g_frames.store(frames < 0 ? 0 : frames > kMaxFrames ? kMaxFrames : frames);
  g_mode_baseline.store(c10::impl::TorchDispatchModeTLS::stack_len());
  g_active.store(true);
  arm_this_thread();
  Py_RETURN_NONE;
}

PyObject* py_stop(PyObject*, PyObject*) {
  g_active.store(false);
  ThreadState* ts = this_thread();
  if (ts != nullptr) disarm_stale(ts);
  Py_RETURN_NONE;
}

PyObject* py_arm_thread(PyObject*, PyObject*) { return PyBool_FromLong(g_active.load() && arm_this_thread()); }

PyObject* py_sequence(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(g_seq.load()); }

template <class T>
PyObject* bytes_of(const std::vector<T>& v) {
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(v.data()),
                                   static_cast<Py_ssize_t>(v.size() * sizeof(T)));
}

PyObject* ops_list(bool everything) {
  std::vector<OpInfo*> fresh;
  {
    std::lock_guard<std::mutex> g(g_ops->mutex);
    if (everything) {
      fresh = g_ops->all;
    } else {
      fresh.swap(g_ops->fresh);
    }
  }
  PyObject* list = PyList_New(0);
  for (OpInfo* op : fresh) {
    const auto& name = op->handle.operator_name();
    PyObject* item = Py_BuildValue("(Iss)", op->id, name.name.c_str(), name.overload_name.c_str());
    if (item == nullptr || PyList_Append(list, item) < 0) {
      Py_XDECREF(item);
      Py_DECREF(list);
      return nullptr;
    }
    Py_DECREF(item);
  }
  return list;
}

PyObject* sites_list(bool everything) {
  std::vector<SiteTable::Site> fresh;
  {
    std::lock_guard<std::mutex> g(g_sites->mutex);
    if (everything) {
      fresh = g_sites->all;
    } else {
      fresh.swap(g_sites->fresh);
    }
  }
  PyObject* list = PyList_New(0);
  for (auto& site : fresh) {
    Py_ssize_t n = static_cast<Py_ssize_t>(site.second.size() / 2);
    PyObject* frames = PyTuple_New(n);
    for (Py_ssize_t i = 0; frames != nullptr && i < n; i++) {
      PyObject* code = reinterpret_cast<PyObject*>(site.second[2 * i]);
      PyObject* pair = Py_BuildValue("(OL)", code, static_cast<long long>(site.second[2 * i + 1]));
      if (pair == nullptr) {
        Py_CLEAR(frames);
        break;
      }
      PyTuple_SET_ITEM(frames, i, pair);
    }
    PyObject* item = frames ? Py_BuildValue("(IN)", site.first, frames) : nullptr;
    if (item == nullptr || PyList_Append(list, item) < 0) {
      Py_XDECREF(item);
      Py_DECREF(list);
      return nullptr;
    }
    Py_DECREF(item);
  }
  return list;
}

PyObject* py_drain(PyObject*, PyObject*) {
  std::vector<std::shared_ptr<Buffer>> buffers;
  {
    std::lock_guard<std::mutex> g(g_registry->mutex);
    buffers = g_registry->buffers;
  }
  std::vector<RecordOut> records;
  std::vector<TensorOut> tensors;
  std::vector<int64_t> dims;
  std::vector<EventOut> events;
  for (auto& buf : buffers) {
    std::vector<RecordOut> r;
    std::vector<TensorOut> t;
    std::vector<int64_t> d;
    std::vector<EventOut> e;
    buf->lock.lock();
    r.swap(buf->records);
    t.swap(buf->tensors);
    d.swap(buf->dims);
    e.swap(buf->events);
    buf->lock.unlock();
    uint32_t tensor_base = static_cast<uint32_t>(tensors.size());
    uint32_t dims_base = static_cast<uint32_t>(dims.size());
    for (RecordOut& x : r) x.tensor_first += tensor_base;
    for (TensorOut& x : t) x.dims_first += dims_base;
    records.insert(records.end(), r.begin(), r.end());
    tensors.insert(tensors.end(), t.begin(), t.end());
    dims.insert(dims.end(), d.begin(), d.end());
    events.insert(events.end(), e.begin(), e.end());
  }
  {
    std::lock_guard<std::mutex> g(g_registry->mutex);  // buffers of threads gone, emptied now
    auto& all = g_registry->buffers;
    for (size_t i = 0; i < all.size();) {
      if (all[i].use_count() == 2 && all[i]->records.empty() && all[i]->events.empty()) {
        all[i] = all.back();
        all.pop_back();
      } else {
        i++;
      }
    }
  }
  PyObject* ops = ops_list(false);
  PyObject* sites = ops ? sites_list(false) : nullptr;
  if (sites == nullptr) {
    Py_XDECREF(ops);
    return nullptr;
  }
  return Py_BuildValue("(NNNNNN)", bytes_of(records), bytes_of(tensors), bytes_of(dims), bytes_of(events), ops,
                       sites);
}

PyObject* py_tables(PyObject*, PyObject*) {
  PyObject* ops = ops_list(true);
  PyObject* sites = ops ? sites_list(true) : nullptr;
  if (sites == nullptr) {
    Py_XDECREF(ops);
    return nullptr;
  }
  return Py_BuildValue("(NN)", ops, sites);
}

PyObject* py_install_gpu_trace(PyObject*, PyObject*) {
  const c10::impl::PyInterpreter* ours = streamsan::interpreter_of<TraceVTable>();
  if (ours == nullptr) {
    return Py_BuildValue("(Os)", Py_False,
                         "this torch's PyInterpreterVTable has methods the observer does not know");
  }
  c10::impl::GPUTrace::set_trace(ours);
  if (c10::impl::GPUTrace::get_trace() == ours) return Py_BuildValue("(Os)", Py_True, "");
  return Py_BuildValue("(Os)", Py_False, "another interpreter owns PyTorch's GPU-trace slot");
}

PyObject* py_owns_gpu_trace(PyObject*, PyObject*) {
  const c10::impl::PyInterpreter* ours = streamsan::interpreter_of<TraceVTable>();
  return PyBool_FromLong(ours != nullptr && c10::impl::GPUTrace::get_trace() == ours);
}

/* The registry of each event kind, by the attribute name torch.cuda._gpu_trace gives it. */
const char* const REGISTRY_NAMES[E_EVENT_SYNC + 1] = {
    nullptr, "EventCreationCallbacks", "EventDeletionCallbacks", "EventRecordCallbacks", "EventWaitCallbacks",
    "MemoryAllocationCallbacks", "MemoryDeallocationCallbacks", "StreamCreationCallbacks",
    "DeviceSynchronizationCallbacks", "StreamSynchronizationCallbacks", "EventSynchronizationCallbacks"};

PyObject* py_forward_gpu_trace(PyObject*, PyObject* module) {
  PyObject* found[E_EVENT_SYNC + 1] = {};
  if (module != Py_None) {
    if (g_fire_callbacks == nullptr && (g_fire_callbacks = PyUnicode_InternFromString("fire_callbacks")) == nullptr)
      return nullptr;
    for (int k = 1; k <= E_EVENT_SYNC; k++) {
      found[k] = PyObject_GetAttrString(module, REGISTRY_NAMES[k]);
      if (found[k] == nullptr) {  // (a torch without that kind of event: nothing to forward there)
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
          for (int j = 1; j < k; j++) Py_XDECREF(found[j]);
          return nullptr;
        }
        PyErr_Clear();
      }
    }
  }
  g_forwarding = false;
  for (int k = 1; k <= E_EVENT_SYNC; k++) {
    PyObject* old = g_registries[k];
    g_registries[k] = found[k];
    Py_XDECREF(old);
  }
  g_forwarding = module != Py_None;
  Py_RETURN_NONE;
}

PyObject* py_quiet_gpu_trace(PyObject*, PyObject* flag) {
  int quiet = PyObject_IsTrue(flag);
  if (quiet < 0) return nullptr;
  g_quiet.store(quiet != 0, std::memory_order_relaxed);
  Py_RETURN_NONE;
}

/* Fires one GPU-trace event through whichever interpreter owns PyTorch's slot, as CUDA code does (so the path
 * from the slot to the callbacks can be checked without a GPU). */
PyObject* py_fire_trace_event(PyObject*, PyObject* args) {
  int kind;
  unsigned long long a = 0, b = 0;
  if (!PyArg_ParseTuple(args, "i|KK", &kind, &a, &b)) return nullptr;
  const c10::impl::PyInterpreter* slot = c10::impl::GPUTrace::get_trace();
  if (slot == nullptr) Py_RETURN_FALSE;
  const auto cuda = c10::DeviceType::CUDA;
  Py_BEGIN_ALLOW_THREADS  // (as in CUDA code: the interpreter takes the GIL itself)
  switch (kind) {
    case E_EVENT_CREATE: (*slot)->trace_gpu_event_creation(cuda, a); break;
    case E_EVENT_DELETE: (*slot)->trace_gpu_event_deletion(cuda, a); break;
    case E_EVENT_RECORD: (*slot)->trace_gpu_event_record(cuda, a, b); break;
    case E_EVENT_WAIT: (*slot)->trace_gpu_event_wait(cuda, a, b); break;
    case E_ALLOC: (*slot)->trace_gpu_memory_allocation(cuda, a); break;
    case E_FREE: (*slot)->trace_gpu_memory_deallocation(cuda, a); break;
    case E_STREAM_CREATE: (*slot)->trace_gpu_stream_creation(cuda, a); break;
    case E_DEVICE_SYNC: (*slot)->trace_gpu_device_synchronization(cuda); break;
    case E_STREAM_SYNC: (*slot)->trace_gpu_stream_synchronization(cuda, a); break;
    case E_EVENT_SYNC: (*slot)->trace_gpu_event_synchronization(cuda, a); break;
    default: break;
  }
  Py_END_ALLOW_THREADS
  if (kind < E_EVENT_CREATE || kind > E_EVENT_SYNC) {
    PyErr_Format(PyExc_ValueError, "no GPU-trace event kind %d", kind);
    return nullptr;
  }
  Py_RETURN_TRUE;
}

PyObject* py_scalar_type_names(PyObject*, PyObject*) {
  int n = static_cast<int>(c10::ScalarType::NumOptions);
  PyObject* names = PyTuple_New(n);
  for (int i = 0; names != nullptr && i < n; i++) {
    PyObject* s = PyUnicode_FromString(c10::toString(static_cast<c10::ScalarType>(i)));
    if (s == nullptr) {
      Py_CLEAR(names);
      break;
    }
    PyTuple_SET_ITEM(names, i, s);
  }
  return names;
}

PyMethodDef methods[] = {
    {"start", py_start, METH_VARARGS, "start(frames): observe from now on, arming the calling thread"},
    {"stop", py_stop, METH_NOARGS, "stop(): observe no more (the calling thread's registration goes at once)"},
    {"arm_thread", py_arm_thread, METH_NOARGS, "arm_thread() -> bool: arm the calling thread (a new thread)"},
    {"sequence", py_sequence, METH_NOARGS, "sequence() -> int: the next sequence number"},
    {"fire_trace_event", py_fire_trace_event, METH_VARARGS,
     "fire_trace_event(kind, a=0, b=0) -> bool: fire a GPU-trace event through the slot's interpreter, as CUDA "
     "code does (False: the slot is empty)"},
    {"drain", py_drain, METH_NOARGS,
     "drain() -> (records, tensors, dims, events, new ops, new sites): what was recorded since the last drain"},
    {"tables", py_tables, METH_NOARGS, "tables() -> (ops, sites): every op and call site met so far"},
    {"install_gpu_trace", py_install_gpu_trace, METH_NOARGS,
     "install_gpu_trace() -> (owned, reason): put the observer in PyTorch's GPU-trace slot"},
    {"owns_gpu_trace", py_owns_gpu_trace, METH_NOARGS, "owns_gpu_trace() -> bool"},
    {"forward_gpu_trace", py_forward_gpu_trace, METH_O,
     "forward_gpu_trace(module or None): also fire that module's Python callbacks for each CUDA trace event"},
    {"quiet_gpu_trace", py_quiet_gpu_trace, METH_O,
     "quiet_gpu_trace(bool): while true, forward nothing (no Python callback wants the events)"},
    {"scalar_type_names", py_scalar_type_names, METH_NOARGS, "c10 ScalarType names, by value"},
    {nullptr, nullptr, 0, nullptr}};

#define STREAMSAN_STR2(x) #x
#define STREAMSAN_STR(x) STREAMSAN_STR2(x)

PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, STREAMSAN_STR(TORCH_EXTENSION_NAME),
                         "streamsan's native observer (streamsan/native/observer.cpp)", -1, methods};

}  // namespace

int add_lane(PyObject* module);  // lane.cpp

#define STREAMSAN_INIT2(name) PyInit_##name
#define STREAMSAN_INIT(name) STREAMSAN_INIT2(name)

PyMODINIT_FUNC STREAMSAN_INIT(TORCH_EXTENSION_NAME)(void) {
  PyObject* m = PyModule_Create(&moduledef);
  if (m == nullptr) return nullptr;
  if (PyModule_AddStringConstant(m, "LAYOUT", kLayout) < 0 ||
      PyModule_AddStringConstant(m, "TORCH_VERSION",
                                 STREAMSAN_STR(TORCH_VERSION_MAJOR) "." STREAMSAN_STR(TORCH_VERSION_MINOR) "." STREAMSAN_STR(TORCH_VERSION_PATCH)) < 0 ||
      PyModule_AddIntConstant(m, "FRAMES_WITHOUT_GIL", STREAMSAN_FRAMES_WITHOUT_GIL) < 0 || add_lane(m) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
