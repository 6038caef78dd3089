/* The torch tracer's common case in C: an aten op on plain CUDA tensors.
 *
 * A `Dispatch` object is installed as a dispatch mode's `__torch_dispatch__` (an instance attribute, so that
 * PyTorch calls it directly, without a Python frame). For an op whose plan it can follow (the plan kinds below) and
 * whose tensors are all plain CUDA tensors, it does what the Python dispatch (`dispatch.dispatch`) does, step for
 * step, and
 * appends the same events; the rare sub-cases (non-contiguous tensors, several outputs, events fired inside the
 * op other than its one allocation, autograd engine threads) call the same Python methods the Python path calls.
 * Anything else it declines before touching the tracer's state: it calls the mode's Python `__torch_dispatch__`
 * (the fallback), which handles every op. So findings are those of the Python tracer, by construction; the
 * tests compare the two event streams on the same programs.
 *
 * Plan kinds (the `kind` of `OpPlan.fast`): any other than these the Python path only; untouched: no access, no
 * fresh output (call the op); allocating: no access, fresh outputs (call the op, size its allocations); accesses:
 * an op with accesses (copies between device tensors too; a copy with a `device` argument, to or from the host, is
 * the Python path's).
 *
 * A `Dispatch` made with a `runner` (the native dispatch lane's, `streamsan/native/lane.cpp`) is called by the lane
 * instead of PyTorch, with the op's arguments converted as PyTorch converts them, and runs the op by calling
 * `runner()` (which runs it on the dispatcher's own stack) where it would call the op.
 *
 * A `Callback` object is one of PyTorch's allocation, free, event record and event wait callbacks
 * (`GpuTrace.install`): the common case here, the rest by the Python callback it wraps.
 *
 * What it reads and calls by name, and the constants it works with (event codes, plan kinds, the field positions
 * of the tuples it reads and makes), are the tracer's: `streamsan/tracers/torch/ccore.py` lists the names and
 * passes the constants to configure(), which keeps them in the static variables below.
 *
 * Needs Python 3.11 or later (the public frame API of the stack capture); before, the module builds empty
 * (`AVAILABLE` 0) and the Python tracer runs alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

#if PY_VERSION_HEX >= 0x030B0000
#include <frameobject.h>

/* Set once by configure(). */
static PyObject *g_tensor_type;  /* torch.Tensor */
static PyObject *g_raw_stream;   /* callable(device) -> raw cudaStream_t of the current stream */
static PyObject *g_describe;     /* callable(tensor) -> "dtype[shape]" */
static PyObject *g_descriptions; /* its memo: (dtype, shape) -> "dtype[shape]" */
static PyObject *g_dev_attr;     /* "is_cuda" (the CPU stand-in of the benchmarks says "is_cpu") */
static long g_dev_offset;        /* added to get_device() (the stand-in's CPU tensors say -1) */
static PyObject *g_op, *g_alloc, *g_zero;
static long g_alloc_code;
static long g_user_kind;
static long g_kind_untouched, g_kind_allocating, g_kind_accesses; /* the plan kinds the core handles */
static int g_cb_alloc, g_cb_free, g_cb_event;                     /* the kinds of a Callback */
static int g_configured;                                          /* whether configure() ran */

/* The positions of the fields of a tuple the core reads or makes: `at` is indexed by the field enums below (the
 * order of the names in the matching *_FIELDS list), `size` is the tuple's length (its least, for an ALLOC event,
 * which may carry a pool after its fields). */
typedef struct {
    Py_ssize_t size;
    Py_ssize_t at[8];
} Layout;

enum { FAST_KIND, FAST_CALL, FAST_NAME, FAST_TENSOR_ARGS, FAST_FRESH_OUTPUTS, FAST_IS_COPY };
static const char *const FAST_FIELDS[] = {"kind", "call", "name", "tensor_args", "fresh_outputs", "is_copy", NULL};
enum { ARG_POSITION, ARG_NAME, ARG_IS_WRITE, ARG_IS_LIST };
static const char *const ARG_FIELDS[] = {"position", "name", "is_write", "is_list", NULL};
enum { CUR_DEVICE, CUR_AGENT, CUR_STACK, CUR_CTX, CUR_THREAD, CUR_EVENTS };
static const char *const CURRENT_OP_FIELDS[] = {"device", "agent", "stack", "ctx", "thread", "events", NULL};
enum { OP_KIND, OP_AGENT, OP_NAME, OP_READS, OP_WRITES, OP_STACK, OP_CTX, OP_FLAGS };
static const char *const OP_FIELDS[] = {"kind", "agent", "name", "reads", "writes", "stack", "ctx", "flags", NULL};
enum { ALLOC_KIND, ALLOC_SPACE, ALLOC_START, ALLOC_SIZE, ALLOC_AGENT, ALLOC_STACK, ALLOC_CTX, ALLOC_WHAT };
static const char *const ALLOC_FIELDS[] = {"kind", "space", "start", "size", "agent", "stack", "ctx", "what", NULL};
enum { FREE_KIND, FREE_SPACE, FREE_START, FREE_STACK };
static const char *const FREE_FIELDS[] = {"kind", "space", "start", "stack", NULL};
enum { SEV_KIND, SEV_EVENT, SEV_AGENT, SEV_STACK };
static const char *const STREAM_EVENT_FIELDS[] = {"kind", "event", "agent", "stack", NULL};

/* OpPlan.fast, an item of its tensor_args, the op being dispatched (`op_agent`), and the OP, ALLOC, FREE and
 * EVENT_RECORD / EVENT_WAIT events */
static Layout L_FAST, L_ARG, L_CUR, L_OP, L_ALLOC, L_FREE, L_SEV;

#define AT(tuple, layout, field) PyTuple_GET_ITEM(tuple, (layout).at[field])

/* A new tuple laid out as `l`: items[k] (a new reference to each) at the position of field k. */
static PyObject *laid_out(const Layout *l, PyObject *const *items) {
    PyObject *t = PyTuple_New(l->size);
    if (t == NULL) return NULL;
    for (Py_ssize_t k = 0; k < l->size; k++) {
        Py_INCREF(items[k]);
        PyTuple_SET_ITEM(t, l->at[k], items[k]);
    }
    return t;
}

static PyObject *s_tracing, *s_plans, *s_buffer, *s_events, *s_ctx, *s_agent_of, *s_op_agent, *s_ops_of_threads,
    *s_saw_cuda,
    *s_batch, *s_engine_threads, *s_stacks, *s_nbytes, *s_data_ptr, *s_is_contiguous, *s_get_device,
    *s_untyped_storage, *s_range_in, *s_output_ranges, *s_place, *s_fill_alloc_sizes, *s_engine_op, *s_flush, *s_agent,
    *s_stop_on_bug, *s_fast, *s_pin_memory, *s_kinds, *s_ids, *s_classify, *s_define, *s_no_frames, *s_key_users,
    *s_max_key, *s_device, *s_agent_for_handle, *s_dtype, *s_shape, *s_stride, *s_element_size, *s_in_scope,
    *s_index_values, *s_spans, *s_values_after;

typedef struct {
    PyObject_HEAD
    PyObject *tracer;
    /* the tracer's attributes that never change, read once: */
    PyObject *buffer, *agent_of, *stacks, *kinds, *ids, *engine_threads, *plans;
    PyObject *index_spans; /* tracer.index_values.spans (a list changed only in place) */
    long key_users, max_key;
    Py_ssize_t batch; /* buffer.batch (set once, when the buffer is made) */
    int saw_cuda;     /* whether this dispatch has set tracer.saw_cuda (which nothing sets back) */
    /* code object -> its kind in the stack table (a memo of `stacks.kinds`, whose code objects the table keeps
     * alive): open addressing, a power-of-two capacity */
    struct KindSlot {
        const void *code;
        long kind;
    } *memo;
    size_t memo_cap, memo_used;
    PyObject *fallback; /* the mode's Python __torch_dispatch__, bound */
    PyObject *self_;    /* the mode (PyTorch checks `__torch_dispatch__.__self__`) */
    PyObject *runner;   /* what runs the op, called with no arguments (the native dispatch lane's); else NULL */
    vectorcallfunc vectorcall;
} Dispatch;

static PyObject *fallback(Dispatch *d, PyObject *const *argv, Py_ssize_t nargs) {
    return PyObject_Vectorcall(d->fallback, argv, nargs, NULL);
}

/* Runs the op: `call(*args, **kwargs)`, or the runner (which has the op's arguments itself). */
static PyObject *call_op(Dispatch *d, PyObject *call, PyObject *args, PyObject *kwargs) {
    if (d->runner != NULL) return PyObject_CallNoArgs(d->runner);
    return PyObject_Call(call, args, kwargs);
}

static PyObject *call_method1(PyObject *obj, PyObject *name, PyObject *a) {
    PyObject *argv[2] = {obj, a};
    return PyObject_VectorcallMethod(name, argv, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

static PyObject *call_method0(PyObject *obj, PyObject *name) {
    PyObject *argv[1] = {obj};
    return PyObject_VectorcallMethod(name, argv, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* Truthiness of obj.<name>; -1 on error. */
static int attr_true(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

static int is_runtime_error(void) { return PyErr_ExceptionMatches(PyExc_RuntimeError); }

/* t.get_device() (+ the configured offset); -2 on error. */
static long device_of(PyObject *t) {
    PyObject *v = call_method0(t, s_get_device);
    if (v == NULL) return -2;
    long d = PyLong_AsLong(v);
    Py_DECREF(v);
    if (d == -1 && PyErr_Occurred()) return -2;
    return d + g_dev_offset;
}

/* (dev, a, b) as a new tuple; steals a and b (NULL-safe: on NULL, the others are released). */
static PyObject *range3(long dev, PyObject *a, PyObject *b) {
    PyObject *dv = PyLong_FromLong(dev), *t = NULL;
    if (dv != NULL && a != NULL && b != NULL && (t = PyTuple_New(3)) != NULL) {
        PyTuple_SET_ITEM(t, 0, dv);
        PyTuple_SET_ITEM(t, 1, a);
        PyTuple_SET_ITEM(t, 2, b);
        return t;
    }
    Py_XDECREF(dv);
    Py_XDECREF(a);
    Py_XDECREF(b);
    return NULL;
}

/* The byte range of a strided device tensor `t` at pointer p of n bytes, as `range_in` gives it: (dev, p, n)
 * when its elements cover its extent densely, else (dev, p, extent, (itemsize, sizes, strides)). Steals p and n.
 * NULL on any error: the caller leaves the tensor to `range_in`. */
static PyObject *strided_range(PyObject *t, long dev, PyObject *p, PyObject *n) {
    PyObject *shape = NULL, *sizes = NULL, *strides = NULL, *its = NULL, *r = NULL;
    if ((shape = PyObject_GetAttr(t, s_shape)) == NULL) goto done;
    if ((sizes = PySequence_Tuple(shape)) == NULL) goto done;
    if ((strides = call_method0(t, s_stride)) == NULL) goto done;
    if ((its = call_method0(t, s_element_size)) == NULL) goto done;
    if (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != PyTuple_GET_SIZE(sizes)) {
        PyErr_SetString(PyExc_RuntimeError, "unexpected strides");
        goto done;
    }
    long long extent = 1;
    int dense = 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(sizes); i++) {
        long long sz = PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, i));
        long long st = PyLong_AsLongLong(PyTuple_GET_ITEM(strides, i));
        if (PyErr_Occurred()) goto done;
        if (sz > 1) {
            if (st == 0) dense = 0;
            extent += (sz - 1) * st;
        }
    }
    long long isz = PyLong_AsLongLong(its);
    if (isz == -1 && PyErr_Occurred()) goto done;
    extent *= isz;
    long long nb = PyLong_AsLongLong(n);
    if (nb == -1 && PyErr_Occurred()) goto done;
    if (dense && extent == nb) {
        Py_INCREF(p);
        Py_INCREF(n);
        r = range3(dev, p, n);
    } else {
        r = Py_BuildValue("(lOL(OOO))", dev, p, extent, its, sizes, strides);
    }
done:
    Py_XDECREF(shape);
    Py_XDECREF(sizes);
    Py_XDECREF(strides);
    Py_XDECREF(its);
    Py_DECREF(p);
    Py_DECREF(n);
    return r;
}

/* The byte range of a device tensor, as the tracer's `range_in(t, dev)` gives it: (dev, ptr, n) for a dense
 * one, with its layout for a strided one; the Python method for the rest (empty, sparse, no storage). New
 * reference, Py_None, or NULL. */
static PyObject *tensor_range(PyObject *tracer, PyObject *t, long dev) {
    PyObject *n = PyObject_GetAttr(t, s_nbytes);
    if (n == NULL) {
        if (!is_runtime_error()) return NULL;
        PyErr_Clear();
        goto python;
    }
    int nonzero = PyObject_IsTrue(n);
    if (nonzero <= 0) {
        Py_DECREF(n);
        if (nonzero < 0) return NULL;
        goto python;
    }
    PyObject *c = call_method0(t, s_is_contiguous);
    if (c == NULL) {
        Py_DECREF(n);
        if (!is_runtime_error()) return NULL;
        PyErr_Clear();
        goto python;
    }
    int contiguous = PyObject_IsTrue(c);
    Py_DECREF(c);
    if (contiguous < 0) {
        Py_DECREF(n);
        return NULL;
    }
    PyObject *p = call_method0(t, s_data_ptr);
    if (p == NULL) {
        Py_DECREF(n);
        if (!is_runtime_error()) return NULL;
        PyErr_Clear();
        goto python;
    }
    if (!contiguous) {
        PyObject *r = strided_range(t, dev, p, n);
        if (r != NULL) return r;
        PyErr_Clear(); /* (sizes that are not plain ints, say): the Python method's case, which meets any real error */
        goto python;
    }
    return range3(dev, p, n);
python:;
    PyObject *dv = PyLong_FromLong(dev);
    if (dv == NULL) return NULL;
    PyObject *argv[3] = {tracer, t, dv};
    PyObject *r2 = PyObject_VectorcallMethod(s_range_in, argv, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(dv);
    return r2;
}

/* `describe(t)`, its memo looked up here: "dtype[shape]". New reference or NULL. */
static PyObject *describe_tensor(PyObject *t) {
    PyObject *dtype = PyObject_GetAttr(t, s_dtype);
    if (dtype == NULL) return NULL;
    PyObject *shape = PyObject_GetAttr(t, s_shape);
    if (shape == NULL) {
        Py_DECREF(dtype);
        return NULL;
    }
    PyObject *key = PyTuple_Pack(2, dtype, shape);
    Py_DECREF(dtype);
    Py_DECREF(shape);
    if (key == NULL) return NULL;
    PyObject *d = PyDict_GetItemWithError(g_descriptions, key); /* borrowed */
    Py_DECREF(key);
    if (d != NULL) {
        Py_INCREF(d);
        return d;
    }
    if (PyErr_Occurred()) return NULL;
    return PyObject_CallOneArg(g_describe, t);
}

/* The kind of a code object in the stack table: OWN 0, LIBRARY 1, USER 2; -1 on error. */
static long code_kind(PyObject *stacks, PyObject *kinds, PyCodeObject *code) {
    PyObject *key = PyLong_FromVoidPtr(code);
    if (key == NULL) return -1;
    PyObject *k = PyDict_GetItemWithError(kinds, key); /* borrowed */
    Py_DECREF(key);
    if (k == NULL) {
        if (PyErr_Occurred()) return -1;
        k = call_method1(stacks, s_classify, (PyObject *)code);
        if (k == NULL) return -1;
        long v = PyLong_AsLong(k);
        Py_DECREF(k);
        return v;
    }
    return PyLong_AsLong(k);
}

/* code_kind, memoized in the dispatch object: most ops walk twenty frames or more (up to the user's code). */
static long memo_kind(Dispatch *d, PyCodeObject *code) {
    size_t mask = d->memo_cap - 1;
    if (d->memo_cap) {
        for (size_t i = ((uintptr_t)code >> 4) & mask; d->memo[i].code != NULL; i = (i + 1) & mask) {
            if (d->memo[i].code == code) return d->memo[i].kind;
        }
    }
    long k = code_kind(d->stacks, d->kinds, code);
    if (k < 0) return k;
    if (2 * (d->memo_used + 1) > d->memo_cap) {
        size_t cap = d->memo_cap ? 2 * d->memo_cap : 1024;
        struct KindSlot *memo = PyMem_Calloc(cap, sizeof(struct KindSlot));
        if (memo == NULL) return k; /* (no memo: still right) */
        for (size_t j = 0; j < d->memo_cap; j++) {
            if (d->memo[j].code == NULL) continue;
            size_t i = ((uintptr_t)d->memo[j].code >> 4) & (cap - 1);
            while (memo[i].code != NULL) i = (i + 1) & (cap - 1);
            memo[i] = d->memo[j];
        }
        PyMem_Free(d->memo);
        d->memo = memo;
        d->memo_cap = cap;
        mask = cap - 1;
    }
    size_t i = ((uintptr_t)code >> 4) & mask;
    while (d->memo[i].code != NULL) i = (i + 1) & mask;
    d->memo[i].code = code;
    d->memo[i].kind = k;
    d->memo_used++;
    return k;
}

/* StackTable.capture for a caller in C: the same key, the same ids, the same DEF_STACK events. */
static PyObject *capture_stack(Dispatch *d, PyObject *events) {
    PyObject *stacks = d->stacks;
    PyObject *key = NULL, *tkey = NULL, *result = NULL;
    PyFrameObject *first = PyEval_GetFrame(); /* borrowed */
    PyFrameObject *f = first;
    PyCodeObject *code = NULL;
    long key_users, max_key, k;
    Py_XINCREF(f);
    if (f == NULL) goto no_frames;
    code = PyFrame_GetCode(f);
    k = memo_kind(d, code);
    while (k <= 0) { /* streamsan's own frames */
        if (k < 0 && PyErr_Occurred()) goto error;
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        Py_DECREF(code);
        code = NULL;
        f = back;
        if (f == NULL) goto no_frames;
        code = PyFrame_GetCode(f);
        k = memo_kind(d, code);
    }
    key_users = d->key_users;
    max_key = d->max_key;
    key = PyList_New(0);
    if (key == NULL) goto error;
    {
        PyObject *cid = PyLong_FromVoidPtr(code);
        PyObject *lasti = PyLong_FromLong(PyFrame_GetLasti(f));
        int bad = cid == NULL || lasti == NULL || PyList_Append(key, cid) < 0 || PyList_Append(key, lasti) < 0;
        Py_XDECREF(cid);
        Py_XDECREF(lasti);
        if (bad) goto error;
    }
    long users = key_users - (k == g_user_kind);
    long walked = max_key;
    while (users > 0 && walked > 0) {
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        Py_DECREF(code);
        code = NULL;
        f = back;
        if (f == NULL) break;
        code = PyFrame_GetCode(f);
        k = memo_kind(d, code);
        if (k < 0 && PyErr_Occurred()) goto error;
        if (k == g_user_kind) {
            PyObject *cid = PyLong_FromVoidPtr(code);
            PyObject *lasti = PyLong_FromLong(PyFrame_GetLasti(f));
            int bad = cid == NULL || lasti == NULL || PyList_Append(key, cid) < 0 || PyList_Append(key, lasti) < 0;
            Py_XDECREF(cid);
            Py_XDECREF(lasti);
            if (bad) goto error;
            users -= 1;
        }
        walked -= 1;
    }
    tkey = PyList_AsTuple(key);
    if (tkey == NULL) goto error;
    {
        PyObject *sid = PyDict_GetItemWithError(d->ids, tkey);
        if (sid != NULL) {
            Py_INCREF(sid);
            result = sid;
        } else if (PyErr_Occurred()) {
            goto error;
        } else {
            PyObject *argv[4] = {stacks, events, tkey, (PyObject *)first};
            result = PyObject_VectorcallMethod(s_define, argv, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        }
    }
    goto done;
no_frames:
    result = call_method1(stacks, s_no_frames, events);
    goto done;
error:
    result = NULL;
done:
    Py_XDECREF(f);
    Py_XDECREF(code);
    Py_XDECREF(key);
    Py_XDECREF(tkey);
    return result;
}

/* Kind 2: an op with no accesses that may allocate (empty, empty_like...): size its allocations. `ran`/`out`
 * tell the caller whether the op ran (on error). */
static PyObject *run_allocating(Dispatch *d, PyObject *call, PyObject *args, PyObject *kwargs, int *ran,
                                PyObject **out_p) {
    PyObject *tracer = d->tracer;
    PyObject *buffer = d->buffer;
    Py_INCREF(buffer);
    PyObject *evs = PyObject_GetAttr(buffer, s_events);
    if (evs == NULL || !PyList_Check(evs)) {
        if (evs != NULL) PyErr_SetString(PyExc_TypeError, "buffer.events is not a list");
        Py_DECREF(buffer);
        Py_XDECREF(evs);
        return NULL;
    }
    Py_ssize_t mark = PyList_GET_SIZE(evs);
    PyObject *out = call_op(d, call, args, kwargs);
    if (out == NULL) {
        *ran = -1; /* the op's own error */
        Py_DECREF(buffer);
        Py_DECREF(evs);
        return NULL;
    }
    *ran = 1;
    Py_INCREF(out);
    *out_p = out;
    PyObject *now = PyObject_GetAttr(buffer, s_events);
    Py_DECREF(buffer);
    if (now == NULL) goto error;
    if (now != evs) mark = 0; /* another thread flushed while the op ran */
    Py_DECREF(evs);
    evs = now;
    if (PyList_GET_SIZE(evs) > mark) {
        PyObject *m = PyLong_FromSsize_t(mark);
        if (m == NULL) goto error;
        PyObject *argv[4] = {tracer, evs, m, out};
        PyObject *r = PyObject_VectorcallMethod(s_fill_alloc_sizes, argv, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(m);
        if (r == NULL) goto error;
        Py_DECREF(r);
    }
    Py_DECREF(evs);
    return out;
error:
    Py_XDECREF(evs);
    Py_DECREF(out);
    return NULL;
}

/* Append the range r (a new reference, may be Py_None) to reads or writes. Steals r. */
static int add_range(PyObject *r, int is_write, PyObject *reads, PyObject *writes) {
    if (r == NULL) return -1;
    int rc = 0;
    if (r != Py_None) rc = PyList_Append(is_write ? writes : reads, r);
    Py_DECREF(r);
    return rc;
}

/* Read one op's accesses from its arguments (kind 3). Returns the device (>= 0), -1 for none, -3 to decline,
 * -2 on error. */
static long scan_args(PyObject *tracer, PyObject *tensor_args, int is_copy, PyObject *args, PyObject *kwargs,
                      PyObject *reads, PyObject *writes) {
    long dev = -1;
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    Py_ssize_t na = PyTuple_GET_SIZE(tensor_args);
    for (Py_ssize_t i = 0; i < na; i++) {
        PyObject *spec = PyTuple_GET_ITEM(tensor_args, i); /* (position, name, is_write, is_list), as L_ARG says */
        long pos = PyLong_AsLong(AT(spec, L_ARG, ARG_POSITION));
        int is_write = PyObject_IsTrue(AT(spec, L_ARG, ARG_IS_WRITE));
        int is_list = PyObject_IsTrue(AT(spec, L_ARG, ARG_IS_LIST));
        PyObject *v; /* borrowed */
        if (0 <= pos && pos < nargs) {
            v = PyTuple_GET_ITEM(args, pos);
        } else {
            v = kwargs != NULL ? PyDict_GetItemWithError(kwargs, AT(spec, L_ARG, ARG_NAME)) : NULL;
            if (v == NULL && PyErr_Occurred()) return -2;
        }
        if (v == NULL || v == Py_None) continue;
        if (is_list) {
            if (!PyList_Check(v) && !PyTuple_Check(v)) return -3;
            PyObject *seq = PySequence_Fast(v, "");
            if (seq == NULL) return -2;
            Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
            PyObject **items = PySequence_Fast_ITEMS(seq);
            if (n && (PyList_Check(items[0]) || PyTuple_Check(items[0]))) {
                Py_DECREF(seq);
                return -3; /* Tensor[][] */
            }
            for (Py_ssize_t j = 0; j < n; j++) {
                PyObject *t = items[j];
                if (t == Py_None) continue;
                int isdev = attr_true(t, g_dev_attr);
                if (isdev <= 0) {
                    Py_DECREF(seq);
                    if (isdev < 0) {
                        PyErr_Clear();
                    }
                    return -3; /* not a device tensor: the Python path's business */
                }
                long d = device_of(t);
                if (d == -2 || add_range(tensor_range(tracer, t, d), is_write, reads, writes) < 0) {
                    Py_DECREF(seq);
                    return -2;
                }
                dev = d;
            }
            Py_DECREF(seq);
            continue;
        }
        int inst = PyObject_IsInstance(v, g_tensor_type);
        if (inst < 0) return -2;
        if (!inst) continue;
        int isdev = attr_true(v, g_dev_attr);
        if (isdev < 0) return -2;
        if (!isdev) return -3; /* a CPU tensor (pinned memory, copies) or another device */
        long d = device_of(v);
        if (d == -2) return -2;
        if (dev < 0 || (is_copy && !is_write)) dev = d; /* a copy runs on its source's device */
        if (add_range(tensor_range(tracer, v, d), is_write, reads, writes) < 0) return -2;
    }
    return dev;
}

/* Whether one of `writes` (ranges) may overlap one of `spans` ((space, lo, hi) of known index values): 1 on any
 * doubt. */
static int touches_spans(PyObject *spans, PyObject *writes) {
    Py_ssize_t ns = PyList_GET_SIZE(spans), nw = PyList_GET_SIZE(writes);
    for (Py_ssize_t i = 0; i < nw; i++) {
        PyObject *w = PyList_GET_ITEM(writes, i);
        if (!PyTuple_Check(w) || PyTuple_GET_SIZE(w) < 3) return 1;
        long long space = PyLong_AsLongLong(PyTuple_GET_ITEM(w, 0));
        long long lo = PyLong_AsLongLong(PyTuple_GET_ITEM(w, 1));
        long long hi = lo + PyLong_AsLongLong(PyTuple_GET_ITEM(w, 2));
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        for (Py_ssize_t j = 0; j < ns; j++) {
            PyObject *s = PyList_GET_ITEM(spans, j);
            if (!PyTuple_Check(s) || PyTuple_GET_SIZE(s) != 3) return 1;
            long long ss = PyLong_AsLongLong(PyTuple_GET_ITEM(s, 0));
            long long slo = PyLong_AsLongLong(PyTuple_GET_ITEM(s, 1));
            long long shi = PyLong_AsLongLong(PyTuple_GET_ITEM(s, 2));
            if (PyErr_Occurred()) {
                PyErr_Clear();
                return 1;
            }
            if (ss == space && slo < hi && lo < shi) return 1;
        }
    }
    return 0;
}

/* Kind 3, after the scan found a device: everything the Python dispatch does from the agent on. `ran`/`out` tell the
 * caller whether the op ran (on error). */
static PyObject *run_traced(Dispatch *d, PyObject *plan, PyObject *call, PyObject *name, int fresh_outputs,
                            PyObject *args,
                            PyObject *kwargs, long dev, PyObject *reads, PyObject *writes, int *ran,
                            PyObject **out_p) {
    PyObject *buffer = NULL, *evs = NULL, *ctx = NULL, *agent = NULL, *stack = NULL, *mine = NULL, *ident = NULL,
             *out = NULL, *op = NULL, *devobj = NULL, *inner = NULL, *ops = NULL;
    PyObject *result = NULL;
    PyObject *single = NULL; /* data pointer of a single contiguous output */
    PyObject *tracer = d->tracer;

    buffer = d->buffer;
    Py_INCREF(buffer);
    evs = PyObject_GetAttr(buffer, s_events);
    if (evs == NULL) goto error;
    if (!PyList_Check(evs)) {
        PyErr_SetString(PyExc_TypeError, "buffer.events is not a list");
        goto error;
    }
    ctx = PyObject_GetAttr(tracer, s_ctx);
    if (ctx == NULL) goto error;
    devobj = PyLong_FromLong(dev);
    if (devobj == NULL) goto error;
    {
        PyObject *raw = PyObject_CallOneArg(g_raw_stream, devobj);
        if (raw == NULL) goto error;
        PyObject *key = PyTuple_Pack(2, devobj, raw);
        if (key == NULL) {
            Py_DECREF(raw);
            goto error;
        }
        PyObject *a = PyDict_GetItemWithError(d->agent_of, key);
        Py_DECREF(key);
        if (a == NULL && PyErr_Occurred()) {
            Py_DECREF(raw);
            goto error;
        }
        int truthy = a != NULL ? PyObject_IsTrue(a) : 0;
        if (truthy > 0) {
            Py_INCREF(a);
            agent = a;
        } else {
            PyObject *argv[3] = {tracer, devobj, raw};
            agent = PyObject_VectorcallMethod(s_agent, argv, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        }
        Py_DECREF(raw);
        if (agent == NULL) goto error;
    }
    stack = capture_stack(d, evs);
    if (stack == NULL) goto error;
    ident = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (ident == NULL) goto error;
    inner = PyList_New(0); /* the op's own events (as the Python path's OpEvents) */
    if (inner == NULL) goto error;
    {
        PyObject *items[6] = {devobj, agent, stack, ctx, ident, inner};
        mine = laid_out(&L_CUR, items);
    }
    if (mine == NULL) goto error;
    if (PyObject_SetAttr(tracer, s_op_agent, mine) < 0) goto error;
    ops = PyObject_GetAttr(buffer, s_ops_of_threads);
    if (ops == NULL || !PyDict_Check(ops) || PyDict_SetItem(ops, ident, mine) < 0) {
        if (ops != NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "ops_of_threads is not a dict");
        goto error;
    }

    Py_ssize_t mark = 0;
    out = call_op(d, call, args, kwargs);
    {
        /* finally: the op is no longer this thread's current op */
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        if (PyDict_DelItem(ops, ident) < 0) PyErr_Clear();
        PyObject *cur = PyObject_GetAttr(tracer, s_op_agent);
        if (cur == mine) PyObject_SetAttr(tracer, s_op_agent, Py_None);
        Py_XDECREF(cur);
        if (out == NULL) {
            PyErr_Restore(et, ev, etb);
            *ran = -1; /* the op's own error */
            goto error;
        }
        PyErr_Clear();
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(etb);
    }
    *ran = 1;
    Py_INCREF(out);
    *out_p = out;
    /* the events this thread fired inside the op, whatever other threads did meanwhile: placed there, then handed
     * to the buffer at once */
    Py_DECREF(evs);
    evs = inner;
    Py_INCREF(evs);
    if (fresh_outputs) {
        int handled = 0;
        if ((PyObject *)Py_TYPE(out) == g_tensor_type) {
            int isdev = attr_true(out, g_dev_attr);
            if (isdev < 0) goto error;
            if (isdev) {
                PyObject *n = PyObject_GetAttr(out, s_nbytes);
                if (n == NULL) {
                    if (!is_runtime_error()) goto error;
                    PyErr_Clear();
                } else {
                    int nz = PyObject_IsTrue(n);
                    int contiguous = 0;
                    if (nz > 0) {
                        PyObject *c = call_method0(out, s_is_contiguous);
                        if (c == NULL) {
                            Py_DECREF(n);
                            goto error;
                        }
                        contiguous = PyObject_IsTrue(c);
                        Py_DECREF(c);
                    }
                    if (nz < 0 || contiguous < 0) {
                        Py_DECREF(n);
                        goto error;
                    }
                    if (nz && contiguous) {
                        single = call_method0(out, s_data_ptr);
                        long od = single != NULL ? device_of(out) : -2;
                        if (od == -2) {
                            Py_DECREF(n);
                            goto error;
                        }
                        Py_INCREF(single);
                        PyObject *r = range3(od, single, n); /* (steals n) */
                        if (r == NULL || PyList_Append(writes, r) < 0) {
                            Py_XDECREF(r);
                            goto error;
                        }
                        Py_DECREF(r);
                        handled = 1;
                    } else {
                        Py_DECREF(n);
                    }
                }
            }
        }
        if (!handled) {
            PyObject *argv[3] = {tracer, out, writes};
            PyObject *r = PyObject_VectorcallMethod(s_output_ranges, argv, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            if (r == NULL) goto error;
            Py_DECREF(r);
        }
    }
    if (!d->saw_cuda) {
        if (PyObject_SetAttr(tracer, s_saw_cuda, Py_True) < 0) goto error;
        d->saw_cuda = 1;
    }
    if (PyList_GET_SIZE(d->index_spans) > 0 &&
        (touches_spans(d->index_spans, writes) || touches_spans(d->index_spans, reads))) {
        /* an op on known index values: the tracer's values_after, as the Python dispatch calls it */
        PyObject *argv[7] = {tracer, plan, args, kwargs != NULL ? kwargs : Py_None, out, reads, writes};
        PyObject *r = PyObject_VectorcallMethod(s_values_after, argv, 7 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (r == NULL) goto error;
        Py_DECREF(r);
    }
    {
        PyObject *rt = PyList_AsTuple(reads), *wt = PyList_AsTuple(writes);
        if (rt == NULL || wt == NULL) {
            Py_XDECREF(rt);
            Py_XDECREF(wt);
            goto error;
        }
        PyObject *items[8] = {g_op, agent, name, rt, wt, stack, ctx, g_zero};
        op = laid_out(&L_OP, items);
        Py_DECREF(rt);
        Py_DECREF(wt);
        if (op == NULL) goto error;
    }
    {
        Py_ssize_t inner = PyList_GET_SIZE(evs) - mark;
        int placed = 0;
        if (inner == 0) {
            if (PyList_Append(evs, op) < 0) goto error;
            placed = 1;
        } else if (inner == 1 && single != NULL) {
            PyObject *ev = PyList_GET_ITEM(evs, mark); /* borrowed */
            if (PyTuple_Check(ev) && PyTuple_GET_SIZE(ev) >= L_ALLOC.size &&
                PyLong_AsLong(AT(ev, L_ALLOC, ALLOC_KIND)) == g_alloc_code) {
                int same = PyObject_RichCompareBool(AT(ev, L_ALLOC, ALLOC_START), single, Py_EQ);
                int sized = same > 0 ? PyObject_IsTrue(AT(ev, L_ALLOC, ALLOC_SIZE)) : 0;
                if (same < 0 || sized < 0) goto error;
                if (same && !sized) {
                    /* the common case: the op allocated its one contiguous output */
                    PyObject *st = call_method0(out, s_untyped_storage);
                    if (st == NULL) goto error;
                    PyObject *size = call_method0(st, s_nbytes);
                    Py_DECREF(st);
                    if (size == NULL) goto error;
                    PyObject *what = describe_tensor(out);
                    if (what == NULL) {
                        Py_DECREF(size);
                        goto error;
                    }
                    PyObject *s5 = AT(ev, L_ALLOC, ALLOC_STACK), *s6 = AT(ev, L_ALLOC, ALLOC_CTX);
                    int t5 = PyObject_IsTrue(s5), t6 = PyObject_IsTrue(s6);
                    if (t5 < 0 || t6 < 0) {
                        Py_DECREF(size);
                        Py_DECREF(what);
                        goto error;
                    }
                    Py_ssize_t len = PyTuple_GET_SIZE(ev);
                    PyObject *nev = PyTuple_New(len);
                    if (nev == NULL) {
                        Py_DECREF(size);
                        Py_DECREF(what);
                        goto error;
                    }
                    PyObject *items[8] = {g_alloc, AT(ev, L_ALLOC, ALLOC_SPACE), single, size,
                                          AT(ev, L_ALLOC, ALLOC_AGENT), t5 ? s5 : stack, t6 ? s6 : ctx, what};
                    for (Py_ssize_t k = 0; k < L_ALLOC.size; k++) {
                        Py_INCREF(items[k]);
                        PyTuple_SET_ITEM(nev, L_ALLOC.at[k], items[k]);
                    }
                    Py_DECREF(size); /* (the tuple holds its own references) */
                    Py_DECREF(what);
                    for (Py_ssize_t i = L_ALLOC.size; i < len; i++) {
                        PyObject *x = PyTuple_GET_ITEM(ev, i);
                        Py_INCREF(x);
                        PyTuple_SET_ITEM(nev, i, x);
                    }
                    if (PyList_SetItem(evs, mark, nev) < 0) goto error; /* steals nev */
                    if (PyList_Append(evs, op) < 0) goto error;
                    placed = 1;
                }
            }
        }
        if (!placed) {
            PyObject *m = PyLong_FromSsize_t(mark);
            if (m == NULL) goto error;
            PyObject *argv[5] = {tracer, evs, m, op, fresh_outputs ? out : Py_None};
            PyObject *r = PyObject_VectorcallMethod(s_place, argv, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            Py_DECREF(m);
            if (r == NULL) goto error;
            Py_DECREF(r);
        }
    }
    {
        int hit = PySet_GET_SIZE(d->engine_threads) ? PySet_Contains(d->engine_threads, ident) : 0;
        if (hit < 0) goto error;
        if (hit) { /* an op of the autograd engine's threads: the Python method that handles them */
            PyObject *kw = kwargs != NULL ? kwargs : PyDict_New();
            if (kw == NULL) goto error;
            PyObject *argv[8] = {tracer, evs, plan, args, kw, out, agent, stack};
            PyObject *r = PyObject_VectorcallMethod(s_engine_op, argv, 8 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            if (kw != kwargs) Py_DECREF(kw);
            if (r == NULL) goto error;
            Py_DECREF(r);
        }
    }
    {
        PyObject *now = PyObject_GetAttr(buffer, s_events);
        if (now == NULL) goto error;
        int ok = PyList_Check(now) && PyList_SetSlice(now, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, evs) == 0;
        Py_ssize_t n = ok ? PyList_GET_SIZE(now) : 0;
        Py_DECREF(now);
        if (!ok) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "buffer.events is not a list");
            goto error;
        }
        if (n >= d->batch) {
            PyObject *r = call_method0(buffer, s_flush);
            if (r == NULL) goto error;
            Py_DECREF(r);
        }
    }
    result = out;
    Py_INCREF(result);
error:
    Py_XDECREF(buffer);
    Py_XDECREF(evs);
    Py_XDECREF(inner);
    Py_XDECREF(ops);
    Py_XDECREF(ctx);
    Py_XDECREF(agent);
    Py_XDECREF(stack);
    Py_XDECREF(mine);
    Py_XDECREF(ident);
    Py_XDECREF(out);
    Py_XDECREF(op);
    Py_XDECREF(devobj);
    Py_XDECREF(single);
    return result;
}

/* A bug of streamsan's own surfaced in the C path: the tracer stops tracing and says so (`stop_on_bug`), and
 * the program goes on: with the op's output if it ran, else the op run now. */
static PyObject *internal_error(Dispatch *d, PyObject *func, PyObject *args, PyObject *kwargs, int ran,
                                PyObject *out) {
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyErr_NormalizeException(&et, &ev, &etb);
    if (etb != NULL && ev != NULL) PyException_SetTraceback(ev, etb);
    PyObject *where = PyObject_Str(func);
    if (where != NULL && ev != NULL) {
        PyObject *argv[3] = {d->tracer, ev, where};
        PyObject *r = PyObject_VectorcallMethod(s_stop_on_bug, argv, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_XDECREF(r);
    }
    PyErr_Clear();
    Py_XDECREF(where);
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(etb);
    if (ran) {
        Py_INCREF(out);
        return out;
    }
    return call_op(d, func, args, kwargs);
}

static PyObject *Dispatch_vectorcall(PyObject *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    Dispatch *d = (Dispatch *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL || nargs < 3 || nargs > 4) return PyObject_Vectorcall(d->fallback, argv, nargsf, kwnames);
    PyObject *func = argv[0], *types = argv[1], *args = argv[2];
    PyObject *kwargs = nargs == 4 ? argv[3] : Py_None;
    if (!PyTuple_Check(args) || (kwargs != Py_None && !PyDict_Check(kwargs))) return fallback(d, argv, nargs);
    if (kwargs == Py_None || PyDict_GET_SIZE(kwargs) == 0) kwargs = NULL;
    if (!PyTuple_Check(types)) return fallback(d, argv, nargs);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); i++) {
        if (PyTuple_GET_ITEM(types, i) != g_tensor_type) return fallback(d, argv, nargs); /* tensor subclasses */
    }
    PyObject *tracer = d->tracer;
    int tracing = attr_true(tracer, s_tracing);
    if (tracing <= 0) {
        PyErr_Clear();
        return fallback(d, argv, nargs);
    }
    if (kwargs != NULL) {
        PyObject *pm = PyDict_GetItemWithError(kwargs, s_pin_memory);
        if (pm == NULL && PyErr_Occurred()) return NULL;
        if (pm != NULL && PyObject_IsTrue(pm) != 0) return fallback(d, argv, nargs);
    }
    PyObject *fid = PyLong_FromVoidPtr(func);
    PyObject *plan = fid != NULL ? PyDict_GetItemWithError(d->plans, fid) : NULL;
    Py_XDECREF(fid);
    Py_XINCREF(plan);
    if (plan == NULL) {
        PyErr_Clear();
        return fallback(d, argv, nargs); /* the first time: the Python path makes the plan */
    }
    PyObject *fast = PyObject_GetAttr(plan, s_fast);
    if (fast == NULL || !PyTuple_Check(fast) || PyTuple_GET_SIZE(fast) != L_FAST.size) {
        Py_DECREF(plan);
        Py_XDECREF(fast);
        PyErr_Clear();
        return fallback(d, argv, nargs);
    }
    long kind = PyLong_AsLong(AT(fast, L_FAST, FAST_KIND));
    PyObject *call = AT(fast, L_FAST, FAST_CALL);
    PyObject *result = NULL;
    if (kind == g_kind_untouched) {
        result = call_op(d, call, args, kwargs);
    } else if (kind == g_kind_allocating) {
        int ran = 0;
        PyObject *out = NULL;
        result = run_allocating(d, call, args, kwargs, &ran, &out);
        if (result == NULL && ran >= 0) result = internal_error(d, func, args, kwargs, ran, out);
        Py_XDECREF(out);
    } else if (kind == g_kind_accesses) {
        PyObject *reads = PyList_New(0), *writes = PyList_New(0);
        if (reads == NULL || writes == NULL) {
            Py_XDECREF(reads);
            Py_XDECREF(writes);
            Py_DECREF(fast);
            Py_DECREF(plan);
            return NULL;
        }
        int is_copy = PyObject_IsTrue(AT(fast, L_FAST, FAST_IS_COPY));
        long dev = -3; /* a copy naming a device (to or from the host, maybe pinned): the Python path's */
        if (!is_copy || kwargs == NULL || !PyDict_Contains(kwargs, s_device))
            dev = scan_args(tracer, AT(fast, L_FAST, FAST_TENSOR_ARGS), is_copy, args, kwargs, reads, writes);
        if (dev == -3 || (dev == -1 && PyObject_IsTrue(AT(fast, L_FAST, FAST_FRESH_OUTPUTS)))) {
            result = fallback(d, argv, nargs);
        } else if (dev == -1 && PyList_GET_SIZE(reads) == 0 && PyList_GET_SIZE(writes) == 0) {
            result = call_op(d, call, args, kwargs);
        } else if (dev == -1) {
            result = fallback(d, argv, nargs); /* a host access */
        } else if (dev == -2) {
            result = internal_error(d, func, args, kwargs, 0, NULL);
        } else {
            int ran = 0;
            PyObject *out = NULL;
            result = run_traced(d, plan, call, AT(fast, L_FAST, FAST_NAME),
                                PyObject_IsTrue(AT(fast, L_FAST, FAST_FRESH_OUTPUTS)), args, kwargs, dev, reads,
                                writes, &ran, &out);
            if (result == NULL && ran >= 0) result = internal_error(d, func, args, kwargs, ran, out);
            Py_XDECREF(out);
        }
        Py_DECREF(reads);
        Py_DECREF(writes);
    } else {
        result = fallback(d, argv, nargs);
    }
    Py_DECREF(fast);
    Py_DECREF(plan);
    return result;
}

/* obj.<name> into *slot, checked to be a dict / set where asked (1 dict, 2 set). */
static int read_attr(PyObject *obj, PyObject *name, PyObject **slot, int what) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    if ((what == 1 && !PyDict_Check(v)) || (what == 2 && !PySet_Check(v))) {
        PyErr_Format(PyExc_TypeError, "tracer attribute %R has an unexpected type", name);
        Py_DECREF(v);
        return -1;
    }
    Py_XSETREF(*slot, v);
    return 0;
}

static int Dispatch_init(Dispatch *self, PyObject *args, PyObject *kwds) {
    PyObject *tracer, *fb, *mode, *runner = Py_None;
    static char *kwlist[] = {"tracer", "fallback", "mode", "runner", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|O", kwlist, &tracer, &fb, &mode, &runner)) return -1;
    if (!g_configured) {
        PyErr_SetString(PyExc_TypeError, "configure() the core first");
        return -1;
    }
    Py_INCREF(tracer);
    Py_INCREF(fb);
    Py_INCREF(mode);
    Py_XSETREF(self->tracer, tracer);
    Py_XSETREF(self->fallback, fb);
    Py_XSETREF(self->self_, mode);
    Py_XSETREF(self->runner, runner == Py_None ? NULL : Py_NewRef(runner));
    PyObject *users = NULL, *max_key = NULL, *known = NULL;
    if (read_attr(tracer, s_buffer, &self->buffer, 0) < 0 || read_attr(tracer, s_agent_of, &self->agent_of, 1) < 0 ||
        read_attr(tracer, s_stacks, &self->stacks, 0) < 0 || read_attr(self->stacks, s_kinds, &self->kinds, 1) < 0 ||
        read_attr(self->stacks, s_ids, &self->ids, 1) < 0 ||
        read_attr(tracer, s_engine_threads, &self->engine_threads, 2) < 0 ||
        read_attr(tracer, s_plans, &self->plans, 1) < 0 || read_attr(self->stacks, s_key_users, &users, 0) < 0 ||
        read_attr(self->stacks, s_max_key, &max_key, 0) < 0 || read_attr(tracer, s_index_values, &known, 0) < 0 ||
        read_attr(known, s_spans, &self->index_spans, 0) < 0) {
        Py_XDECREF(users);
        Py_XDECREF(max_key);
        Py_XDECREF(known);
        return -1;
    }
    Py_DECREF(known);
    self->key_users = PyLong_AsLong(users);
    self->max_key = PyLong_AsLong(max_key);
    Py_DECREF(users);
    Py_DECREF(max_key);
    if (PyErr_Occurred()) return -1;
    if (!PyList_Check(self->index_spans)) {
        PyErr_SetString(PyExc_TypeError, "tracer.index_values.spans is not a list");
        return -1;
    }
    PyObject *batch = PyObject_GetAttr(self->buffer, s_batch);
    self->batch = batch != NULL ? PyLong_AsSsize_t(batch) : -1;
    Py_XDECREF(batch);
    self->saw_cuda = 0;
    if (self->batch < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "the event buffer's batch is negative");
        return -1;
    }
    return 0;
}

/* The object fields of a C type here, by offset, for its GC slots. */
static int visit_fields(PyObject *self, const Py_ssize_t *fields, visitproc visit, void *arg) {
    for (; *fields >= 0; fields++) Py_VISIT(*(PyObject **)((char *)self + *fields));
    return 0;
}

static void clear_fields(PyObject *self, const Py_ssize_t *fields) {
    for (; *fields >= 0; fields++) Py_CLEAR(*(PyObject **)((char *)self + *fields));
}

static const Py_ssize_t dispatch_fields[] = {
    offsetof(Dispatch, buffer), offsetof(Dispatch, agent_of), offsetof(Dispatch, stacks),
    offsetof(Dispatch, kinds), offsetof(Dispatch, ids), offsetof(Dispatch, engine_threads),
    offsetof(Dispatch, plans), offsetof(Dispatch, tracer), offsetof(Dispatch, fallback), offsetof(Dispatch, self_),
    offsetof(Dispatch, runner),
    offsetof(Dispatch, index_spans), -1};

static PyObject *Dispatch_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Dispatch *self = (Dispatch *)type->tp_alloc(type, 0);
    if (self != NULL) self->vectorcall = Dispatch_vectorcall;
    return (PyObject *)self;
}

static int Dispatch_traverse(Dispatch *self, visitproc visit, void *arg) {
    return visit_fields((PyObject *)self, dispatch_fields, visit, arg);
}

static int Dispatch_clear(Dispatch *self) {
    clear_fields((PyObject *)self, dispatch_fields);
    return 0;
}

static void Dispatch_dealloc(Dispatch *self) {
    PyObject_GC_UnTrack(self);
    PyMem_Free(self->memo);
    Dispatch_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Dispatch_get_self(Dispatch *self, void *closure) {
    PyObject *r = self->self_ != NULL ? self->self_ : Py_None;
    Py_INCREF(r);
    return r;
}

/* capture(events): the caller's stack id, as `StackTable.capture(events, skip)` gives it where every frame skipped
 * is streamsan's own (DEF_STACK appended to events for a new one). */
static PyObject *Dispatch_capture(Dispatch *self, PyObject *events) {
    if (!PyList_Check(events)) {
        PyErr_SetString(PyExc_TypeError, "events must be a list");
        return NULL;
    }
    return capture_stack(self, events);
}

static PyMethodDef Dispatch_methods[] = {
    {"capture", (PyCFunction)Dispatch_capture, METH_O, "capture(events): the caller's stack id (streamsan's own "
                                                       "frames skipped), its DEF_STACK appended when new"},
    {NULL},
};

static PyGetSetDef Dispatch_getset[] = {
    {"__self__", (getter)Dispatch_get_self, NULL, "the dispatch mode", NULL},
    {NULL},
};

static PyTypeObject DispatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "streamsan._ctracer.Dispatch",
    .tp_basicsize = sizeof(Dispatch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Dispatch(tracer, fallback, mode): a dispatch mode's __torch_dispatch__ whose common case runs in C",
    .tp_new = Dispatch_new,
    .tp_init = (initproc)Dispatch_init,
    .tp_dealloc = (destructor)Dispatch_dealloc,
    .tp_traverse = (traverseproc)Dispatch_traverse,
    .tp_clear = (inquiry)Dispatch_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Dispatch, vectorcall),
    .tp_getset = Dispatch_getset,
    .tp_methods = Dispatch_methods,
};

/* PyTorch's allocation and free callbacks, the hottest two, and its event record and wait callbacks (their stack
 * capture is the costly part in Python) (`GpuTrace.install`): the common case here, the rest (and any failure
 * before a change) by the Python callback it was made from. */
typedef struct {
    PyObject_HEAD
    PyObject *gputrace; /* the GpuTrace class: its `active` tracer */
    PyObject *fallback; /* the Python callback */
    int kind;           /* g_cb_alloc, g_cb_free or g_cb_event (an event record or wait: `event` is its code) */
    PyObject *event;
    /* the last active tracer and its attributes that never change */
    PyObject *seen, *live, *buffer, *pools, *grads;
    Py_ssize_t batch; /* the buffer's batch size */
    PyObject *capture; /* a Dispatch of the tracer seen, for its stack capture only (made at the first need) */
    vectorcallfunc vectorcall;
} Callback;

static PyObject *s_active, *s_live_device, *s_pool_of_thread, *s_engine_grads;
static PyObject *g_free_kind, *g_empty_str;

/* The active tracer if it is tracing (a new reference; its fixed attributes read into c), Py_None (not tracing),
 * or NULL (error). */
static PyObject *active_tracer(Callback *c) {
    PyObject *t = PyObject_GetAttr(c->gputrace, s_active);
    if (t == NULL) return NULL;
    if (t == Py_None) {
        Py_DECREF(t);
        return Py_None;
    }
    if (t != c->seen) {
        PyObject *live = PyObject_GetAttr(t, s_live_device), *buffer = PyObject_GetAttr(t, s_buffer),
                 *pools = PyObject_GetAttr(t, s_pool_of_thread), *grads = PyObject_GetAttr(t, s_engine_grads);
        PyObject *batch = buffer != NULL ? PyObject_GetAttr(buffer, s_batch) : NULL;
        Py_ssize_t b = batch != NULL ? PyLong_AsSsize_t(batch) : -1;
        Py_XDECREF(batch);
        if (live == NULL || buffer == NULL || pools == NULL || grads == NULL || b < 0 || !PyDict_Check(live) ||
            !PyDict_Check(pools) || !PySet_Check(grads)) {
            Py_XDECREF(live);
            Py_XDECREF(buffer);
            Py_XDECREF(pools);
            Py_XDECREF(grads);
            Py_DECREF(t);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a tracer of another kind");
            return NULL;
        }
        Py_XSETREF(c->live, live);
        Py_XSETREF(c->buffer, buffer);
        Py_XSETREF(c->pools, pools);
        Py_XSETREF(c->grads, grads);
        c->batch = b;
        Py_INCREF(t);
        Py_XSETREF(c->seen, t);
        Py_CLEAR(c->capture);
    }
    int tracing = attr_true(t, s_tracing);
    if (tracing <= 0) {
        Py_DECREF(t);
        return tracing < 0 ? NULL : Py_None;
    }
    return t;
}

/* Whether op_agent `cur` is an op of this thread (the tracer: `cur is not None and cur[4] == _get_ident()`):
 * 1, 0, or -1 on error. */
static int op_of_this_thread(PyObject *cur) {
    if (!PyTuple_Check(cur) || PyTuple_GET_SIZE(cur) != L_CUR.size) return 0;
    PyObject *ident = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    int mine = ident != NULL ? PyObject_RichCompareBool(AT(cur, L_CUR, CUR_THREAD), ident, Py_EQ) : -1;
    Py_XDECREF(ident);
    return mine;
}

/* The list an event fired inside op_agent `cur` of this thread goes to: the op's own (its `events`, the Python
 * path's OpEvents). New reference, or NULL on error. */
static PyObject *op_events(PyObject *cur) {
    PyObject *l = AT(cur, L_CUR, CUR_EVENTS);
    if (!PyList_Check(l)) {
        PyErr_SetString(PyExc_TypeError, "an op's own events are not a list");
        return NULL;
    }
    Py_INCREF(l);
    return l;
}

/* The op this thread is dispatching, as the tracer's op_of_this_thread: `op_agent` if it is this thread's, else
 * this thread's entry of `ops_of_threads`. A new reference, or Py_None (new reference too) outside an op of this
 * thread; NULL on error. */
static PyObject *this_threads_op(PyObject *t) {
    PyObject *cur = PyObject_GetAttr(t, s_op_agent);
    if (cur == NULL) return NULL;
    int mine = op_of_this_thread(cur);
    if (mine != 0) {
        if (mine < 0) Py_CLEAR(cur);
        return cur;
    }
    Py_DECREF(cur);
    PyObject *buffer = PyObject_GetAttr(t, s_buffer);
    if (buffer == NULL) return NULL;
    PyObject *ops = PyObject_GetAttr(buffer, s_ops_of_threads);
    Py_DECREF(buffer);
    if (ops == NULL) return NULL;
    PyObject *r = Py_None;
    if (PyDict_Check(ops) && PyDict_GET_SIZE(ops)) {
        PyObject *ident = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
        PyObject *got = ident != NULL ? PyDict_GetItemWithError(ops, ident) : NULL;
        Py_XDECREF(ident);
        if (got == NULL && (ident == NULL || PyErr_Occurred())) {
            Py_DECREF(ops);
            return NULL;
        }
        if (got != NULL && op_of_this_thread(got) > 0) r = got;
    }
    Py_INCREF(r);
    Py_DECREF(ops);
    return r;
}

/* 1 done, 0 the Python callback's case, -1 error (nothing changed then). */
static int on_alloc(Callback *c, PyObject *t, PyObject *ptr) {
    PyObject *cur = this_threads_op(t);
    if (cur == NULL) return -1;
    int rc = 0;
    int in_op = cur != Py_None;
    if (!in_op) { /* `on_alloc` does nothing there outside hooked regions (hooks scope) */
        int scope = attr_true(t, s_in_scope);
        rc = scope < 0 ? -1 : (scope ? 0 : 1);
    } else if (PyDict_GET_SIZE(c->pools) == 0 && PyLong_AsLong(AT(cur, L_CUR, CUR_DEVICE)) >= 0) {
        /* an op's own allocation (inside a host op, device -1, the Python callback finds its stream) */
        PyObject *evs = op_events(cur);
        PyObject *ev = NULL;
        PyObject *items[8] = {g_alloc,          AT(cur, L_CUR, CUR_DEVICE), ptr, g_zero, AT(cur, L_CUR, CUR_AGENT),
                              AT(cur, L_CUR, CUR_STACK), AT(cur, L_CUR, CUR_CTX), g_empty_str};
        if (evs == NULL) {
            rc = -1;
        } else if ((ev = laid_out(&L_ALLOC, items)) == NULL) {
            rc = -1;
        } else if (PyDict_SetItem(c->live, ptr, AT(cur, L_CUR, CUR_DEVICE)) < 0) {
            rc = -1;
        } else {
            rc = PyList_Append(evs, ev) < 0 ? -1 : 1;
        }
        Py_XDECREF(ev);
        Py_XDECREF(evs);
    }
    Py_DECREF(cur);
    return rc;
}

/* As the tracer's emit after a callback's event: flush once callbacks alone have filled the buffer several times
 * over, and only outside ops (a flush never splits an op from the events fired inside it). 0, or -1 on error. */
static int flush_if_full(PyObject *t, PyObject *buffer, Py_ssize_t batch, PyObject *evs) {
    if (PyList_GET_SIZE(evs) < 4 * batch) return 0;
    PyObject *cur = PyObject_GetAttr(t, s_op_agent);
    if (cur == NULL) return -1;
    int rc = 0;
    if (cur == Py_None) {
        PyObject *r = call_method0(buffer, s_flush);
        if (r == NULL) rc = -1;
        Py_XDECREF(r);
    }
    Py_DECREF(cur);
    return rc;
}

static int on_free(Callback *c, PyObject *t, PyObject *ptr) {
    /* (the flush below runs Python code, where another thread may make another tracer active: this one's
     * attributes are held here) */
    PyObject *live = c->live, *buffer = c->buffer, *grads = c->grads;
    Py_ssize_t batch = c->batch;
    PyObject *dev = PyDict_GetItemWithError(live, ptr);
    if (dev == NULL) return PyErr_Occurred() ? -1 : 1; /* not a block of the tracer's */
    PyObject *cur = this_threads_op(t);
    if (cur == NULL) return -1;
    int in_op = cur != Py_None;
    PyObject *evs = in_op ? op_events(cur) : PyObject_GetAttr(buffer, s_events);
    Py_DECREF(cur);
    if (evs == NULL || !PyList_Check(evs)) {
        Py_XDECREF(evs);
        return -1;
    }
    Py_INCREF(buffer);
    Py_INCREF(grads);
    PyObject *items[4] = {g_free_kind, dev, ptr, g_zero};
    PyObject *ev = laid_out(&L_FREE, items);
    int rc = ev != NULL && PyDict_DelItem(live, ptr) == 0 && PyList_Append(evs, ev) == 0 ? 1 : -1;
    Py_XDECREF(ev);
    if (rc == 1 && !in_op && flush_if_full(t, buffer, batch, evs) < 0) rc = -1;
    if (rc == 1 && PySet_GET_SIZE(grads) && PySet_Discard(grads, ptr) < 0) rc = -1;
    Py_DECREF(evs);
    Py_DECREF(buffer);
    Py_DECREF(grads);
    return rc;
}

/* An event record or wait on stream handle s, as `on_event_record` / `on_event_wait`: (code, event, the stream's
 * agent, the stack: the op's own inside an op of this thread, else captured here). 1 done, -1 error. */
static int on_event(Callback *c, PyObject *t, PyObject *e, PyObject *s) {
    PyObject *agent = NULL, *cur = NULL, *stack = NULL, *evs = NULL, *ev = NULL;
    int rc = -1;
    PyObject *buffer = c->buffer;
    Py_ssize_t batch = c->batch;
    Py_INCREF(buffer);
    {
        PyObject *argv[2] = {t, s};
        agent = PyObject_VectorcallMethod(s_agent_for_handle, argv, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    if (agent == NULL) goto done;
    if ((cur = this_threads_op(t)) == NULL) goto done;
    int mine = cur != Py_None;
    if (mine) { /* the op's own stack, and its own list */
        stack = AT(cur, L_CUR, CUR_STACK);
        Py_INCREF(stack);
        if ((evs = op_events(cur)) == NULL) goto done;
    } else {
        if ((evs = PyObject_GetAttr(buffer, s_events)) == NULL) goto done;
        if (!PyList_Check(evs)) goto done;
    }
    if (stack == NULL) {
        /* t's capture, held here: Python code run meanwhile (by the calls above and below) may let another thread
         * make another tracer active and replace c->capture */
        PyObject *cap = c->capture;
        if (cap != NULL && ((Dispatch *)cap)->tracer == t) {
            Py_INCREF(cap);
        } else {
            cap = PyObject_CallFunctionObjArgs((PyObject *)&DispatchType, t, Py_None, Py_None, NULL);
            if (cap == NULL) goto done;
            if (c->seen == t) {
                Py_INCREF(cap);
                Py_XSETREF(c->capture, cap);
            }
        }
        stack = capture_stack((Dispatch *)cap, evs);
        Py_DECREF(cap);
        if (stack == NULL) goto done;
        PyObject *now = PyObject_GetAttr(buffer, s_events); /* (the capture may have run Python code) */
        if (now == NULL) goto done;
        Py_SETREF(evs, now);
        if (!PyList_Check(evs)) goto done;
    }
    {
        PyObject *items[4] = {c->event, e, agent, stack};
        ev = laid_out(&L_SEV, items);
    }
    if (ev == NULL || PyList_Append(evs, ev) < 0) goto done;
    rc = !mine && flush_if_full(t, buffer, batch, evs) < 0 ? -1 : 1;
done:
    Py_XDECREF(agent);
    Py_XDECREF(cur);
    Py_XDECREF(stack);
    Py_XDECREF(evs);
    Py_XDECREF(ev);
    Py_DECREF(buffer);
    return rc;
}

static PyObject *Callback_vectorcall(PyObject *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    Callback *c = (Callback *)self;
    if (kwnames != NULL || PyVectorcall_NARGS(nargsf) != (c->kind == g_cb_event ? 2 : 1))
        return PyObject_Vectorcall(c->fallback, argv, nargsf, kwnames);
    PyObject *t = active_tracer(c);
    if (t == Py_None) {
        /* not tracing: an event record or wait may still be an edge of a CUDA graph being captured, and a free
         * during a capture is still a free (Python's) */
        if (c->kind != g_cb_alloc) return PyObject_Vectorcall(c->fallback, argv, nargsf, NULL);
        Py_RETURN_NONE;
    }
    int rc = -1;
    if (t != NULL) {
        rc = c->kind == g_cb_free    ? on_free(c, t, argv[0])
             : c->kind == g_cb_alloc ? on_alloc(c, t, argv[0])
                                   : on_event(c, t, argv[0], argv[1]);
        Py_DECREF(t);
    }
    if (rc == 1) Py_RETURN_NONE;
    if (rc < 0) PyErr_Clear(); /* the Python callback meets the same failure, and logs it */
    return PyObject_Vectorcall(c->fallback, argv, nargsf, NULL);
}

static int Callback_init(Callback *self, PyObject *args, PyObject *kwds) {
    PyObject *gputrace, *fb;
    int kind;
    PyObject *event = Py_None;
    static char *kwlist[] = {"gputrace", "fallback", "kind", "event", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOi|O", kwlist, &gputrace, &fb, &kind, &event)) return -1;
    if (!g_configured) {
        PyErr_SetString(PyExc_TypeError, "configure() the core first");
        return -1;
    }
    if ((kind != g_cb_alloc && kind != g_cb_free && kind != g_cb_event) || (kind == g_cb_event && !PyLong_Check(event))) {
        PyErr_SetString(PyExc_ValueError, "kind is the allocation, free or event kind configured (an event with its "
                                          "event code)");
        return -1;
    }
    Py_INCREF(event);
    Py_XSETREF(self->event, event);
    Py_INCREF(gputrace);
    Py_INCREF(fb);
    Py_XSETREF(self->gputrace, gputrace);
    Py_XSETREF(self->fallback, fb);
    self->kind = kind;
    return 0;
}

static PyObject *Callback_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Callback *self = (Callback *)type->tp_alloc(type, 0);
    if (self != NULL) self->vectorcall = Callback_vectorcall;
    return (PyObject *)self;
}

static const Py_ssize_t callback_fields[] = {
    offsetof(Callback, seen), offsetof(Callback, live), offsetof(Callback, buffer), offsetof(Callback, pools),
    offsetof(Callback, grads), offsetof(Callback, gputrace), offsetof(Callback, fallback), offsetof(Callback, event),
    offsetof(Callback, capture), -1};

static int Callback_traverse(Callback *self, visitproc visit, void *arg) {
    return visit_fields((PyObject *)self, callback_fields, visit, arg);
}

static int Callback_clear(Callback *self) {
    clear_fields((PyObject *)self, callback_fields);
    return 0;
}

static void Callback_dealloc(Callback *self) {
    PyObject_GC_UnTrack(self);
    Callback_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject CallbackType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "streamsan._ctracer.Callback",
    .tp_basicsize = sizeof(Callback),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Callback(gputrace, fallback, kind, event=None): PyTorch's allocation (kind 0), free (1) or event "
              "record or wait (2, with its event code) callback, its common case in C",
    .tp_new = Callback_new,
    .tp_init = (initproc)Callback_init,
    .tp_dealloc = (destructor)Callback_dealloc,
    .tp_traverse = (traverseproc)Callback_traverse,
    .tp_clear = (inquiry)Callback_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Callback, vectorcall),
};

/* layouts[which] (a dict: field name -> position) into *l, for the fields the core names (`fields`): it must name
 * exactly those, at distinct positions from 0 on. 0, or -1 with an exception set. */
static int read_layout(PyObject *layouts, const char *which, const char *const *fields, Layout *l) {
    PyObject *d = PyDict_GetItemString(layouts, which); /* borrowed */
    Py_ssize_t n = 0;
    while (fields[n] != NULL) n++;
    if (d == NULL || !PyDict_Check(d) || PyDict_GET_SIZE(d) != n || n > 8) {
        PyErr_Format(PyExc_ValueError, "configure: the layout %s does not name the fields the core reads", which);
        return -1;
    }
    int seen[8] = {0};
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *v = PyDict_GetItemString(d, fields[k]); /* borrowed */
        Py_ssize_t at = v != NULL ? PyLong_AsSsize_t(v) : -1;
        if (at < 0 || at >= n || seen[at]) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "configure: the layout %s places %s badly", which, fields[k]);
            return -1;
        }
        seen[at] = 1;
        l->at[k] = at;
    }
    l->size = n;
    return 0;
}

/* codes[name] as a long into *v. 0, or -1 with an exception set. */
static int read_code(PyObject *codes, const char *name, long *v) {
    PyObject *x = PyDict_GetItemString(codes, name); /* borrowed */
    *v = x != NULL ? PyLong_AsLong(x) : -1;
    if (x == NULL || (*v == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "configure: no code for %s", name);
        return -1;
    }
    return 0;
}

static PyObject *configure(PyObject *module, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tensor_type", "raw_stream", "describe", "descriptions", "op", "alloc", "free",
                             "user_kind", "device_attr", "device_offset", "plan_kinds", "callback_kinds", "layouts",
                             NULL};
    PyObject *tt, *rs, *desc, *descs, *op, *alloc, *fr, *uk, *da, *pk, *ck, *lay;
    long off;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO!OOOOUlO!O!O!", kwlist, &tt, &rs, &desc, &PyDict_Type, &descs,
                                     &op, &alloc, &fr, &uk, &da, &off, &PyDict_Type, &pk, &PyDict_Type, &ck,
                                     &PyDict_Type, &lay))
        return NULL;
    long untouched, allocating, accesses, cb_alloc, cb_free, cb_event;
    Layout fast, arg, cur, opl, all, fre, sev;
    if (read_code(pk, "untouched", &untouched) < 0 || read_code(pk, "allocating", &allocating) < 0 ||
        read_code(pk, "accesses", &accesses) < 0 || read_code(ck, "alloc", &cb_alloc) < 0 ||
        read_code(ck, "free", &cb_free) < 0 || read_code(ck, "event", &cb_event) < 0 ||
        read_layout(lay, "fast", FAST_FIELDS, &fast) < 0 || read_layout(lay, "arg", ARG_FIELDS, &arg) < 0 ||
        read_layout(lay, "current_op", CURRENT_OP_FIELDS, &cur) < 0 || read_layout(lay, "op", OP_FIELDS, &opl) < 0 ||
        read_layout(lay, "alloc", ALLOC_FIELDS, &all) < 0 || read_layout(lay, "free", FREE_FIELDS, &fre) < 0 ||
        read_layout(lay, "stream_event", STREAM_EVENT_FIELDS, &sev) < 0)
        return NULL;
    Py_INCREF(descs);
    Py_XSETREF(g_descriptions, descs);
    Py_INCREF(tt);
    Py_XSETREF(g_tensor_type, tt);
    Py_INCREF(rs);
    Py_XSETREF(g_raw_stream, rs);
    Py_INCREF(desc);
    Py_XSETREF(g_describe, desc);
    Py_INCREF(op);
    Py_XSETREF(g_op, op);
    Py_INCREF(alloc);
    Py_XSETREF(g_alloc, alloc);
    Py_INCREF(fr);
    Py_XSETREF(g_free_kind, fr);
    g_alloc_code = PyLong_AsLong(alloc);
    g_user_kind = PyLong_AsLong(uk);
    Py_INCREF(da);
    PyUnicode_InternInPlace(&da);
    Py_XSETREF(g_dev_attr, da);
    g_dev_offset = off;
    g_kind_untouched = untouched;
    g_kind_allocating = allocating;
    g_kind_accesses = accesses;
    g_cb_alloc = (int)cb_alloc;
    g_cb_free = (int)cb_free;
    g_cb_event = (int)cb_event;
    L_FAST = fast;
    L_ARG = arg;
    L_CUR = cur;
    L_OP = opl;
    L_ALLOC = all;
    L_FREE = fre;
    L_SEV = sev;
    if (PyErr_Occurred()) return NULL;
    g_configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(tensor_type, raw_stream, describe, descriptions, op, alloc, free, user_kind, device_attr, "
     "device_offset, plan_kinds, callback_kinds, layouts): what the core works with (the tracer's ccore.py)"},
    {NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "streamsan._ctracer",
                                       "The torch tracer's common case in C (see the source's header).", -1,
                                       methods};

#define INTERN(var, text)                                                                                      \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;

PyMODINIT_FUNC PyInit__ctracer(void) {
    INTERN(s_tracing, "tracing");
    INTERN(s_plans, "plans");
    INTERN(s_buffer, "buffer");
    INTERN(s_events, "events");
    INTERN(s_ctx, "ctx");
    INTERN(s_agent_of, "agent_of");
    INTERN(s_op_agent, "op_agent");
    INTERN(s_ops_of_threads, "ops_of_threads");
    INTERN(s_saw_cuda, "saw_cuda");
    INTERN(s_batch, "batch");
    INTERN(s_index_values, "index_values");
    INTERN(s_spans, "spans");
    INTERN(s_values_after, "values_after");
    INTERN(s_engine_threads, "engine_threads");
    INTERN(s_stacks, "stacks");
    INTERN(s_nbytes, "nbytes");
    INTERN(s_data_ptr, "data_ptr");
    INTERN(s_is_contiguous, "is_contiguous");
    INTERN(s_get_device, "get_device");
    INTERN(s_untyped_storage, "untyped_storage");
    INTERN(s_range_in, "range_in");
    INTERN(s_output_ranges, "output_ranges");
    INTERN(s_place, "place");
    INTERN(s_fill_alloc_sizes, "fill_alloc_sizes");
    INTERN(s_engine_op, "engine_op");
    INTERN(s_flush, "flush");
    INTERN(s_agent, "agent");
    INTERN(s_stop_on_bug, "stop_on_bug");
    INTERN(s_fast, "fast");
    INTERN(s_pin_memory, "pin_memory");
    INTERN(s_kinds, "kinds");
    INTERN(s_ids, "ids");
    INTERN(s_classify, "classify");
    INTERN(s_define, "define");
    INTERN(s_no_frames, "no_frames");
    INTERN(s_key_users, "key_users");
    INTERN(s_max_key, "max_key");
    INTERN(s_device, "device");
    INTERN(s_agent_for_handle, "agent_for_handle");
    INTERN(s_dtype, "dtype");
    INTERN(s_shape, "shape");
    INTERN(s_stride, "stride");
    INTERN(s_element_size, "element_size");
    INTERN(s_in_scope, "in_scope");
    INTERN(s_active, "active");
    INTERN(s_live_device, "live_device");
    INTERN(s_pool_of_thread, "pool_of_thread");
    INTERN(s_engine_grads, "engine_grads");
    g_empty_str = PyUnicode_InternFromString("");
    g_zero = PyLong_FromLong(0);
    if (PyType_Ready(&DispatchType) < 0 || PyType_Ready(&CallbackType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&DispatchType);
    if (PyModule_AddObject(m, "Dispatch", (PyObject *)&DispatchType) < 0) return NULL;
    Py_INCREF(&CallbackType);
    if (PyModule_AddObject(m, "Callback", (PyObject *)&CallbackType) < 0) return NULL;
    if (PyModule_AddIntConstant(m, "AVAILABLE", 1) < 0) return NULL;
    return m;
}

#else /* before Python 3.11: no public frame API the stack capture needs; the Python tracer runs */

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "streamsan._ctracer",
                                       "Not available before Python 3.11.", -1, NULL};

PyMODINIT_FUNC PyInit__ctracer(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (m != NULL && PyModule_AddIntConstant(m, "AVAILABLE", 0) < 0) return NULL;
    return m;
}

#endif
