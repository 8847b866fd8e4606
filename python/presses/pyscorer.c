/* Presses written in Python inside the engine: the module's kvc_scorer_callback (kvpress_c.h). A Python press's
 * config names this function by its address ("callback", from scorer_callback_address()) and itself by a token
 * ("callback_user"); the engine calls it for every layer it compresses, on the thread of the forward, with the
 * GIL released. It takes the GIL for the Python call only: the view's arrays as read-only NumPy arrays and DLViews
 * (dlview.c) over the engine's memory, the K/V store's own rows where it lends them (KVC_VIEW_IN_PLACE), all holding
 * the call's ViewMemory: one still held when the call ends has the view retained (kvc_scorer_view_retain), so no
 * array ever reads freed memory. They are handed to the dispatcher kvpress_c registered
 * (kvpress_c/presses/python_press.py: token -> press.score(layer) or press.compress(layer)); the result checked
 * (shape, dtype) and copied into the view. A Python exception is kept for this thread and raised again by
 * kvc_py_raise when the forward's failure reaches Python, with its traceback. */
#include "core.h"

static PyObject *dispatcher; /* kvpress_c's: dispatch(token, select, layer_dict) -> scores or kept rows */

/* The exception of this thread's last failed callback, raised again by kvc_py_raise. */
static _Thread_local PyObject *pending_type, *pending_value, *pending_tb;

static void keep_pending(void) {
    Py_XDECREF(pending_type), Py_XDECREF(pending_value), Py_XDECREF(pending_tb);
    PyErr_Fetch(&pending_type, &pending_value, &pending_tb);
    PyErr_NormalizeException(&pending_type, &pending_value, &pending_tb);
    if (pending_tb) PyException_SetTraceback(pending_value, pending_tb);
}

static _Thread_local int raised_last; /* whether this thread's last kvc_py_raise was a Python press's exception */

int kvc_py_press_raised(void) { return raised_last; }

int kvc_py_raise_pending(void) {
    const char *msg = kvc_last_error();
    raised_last = msg && strstr(msg, "the callback scorer") != NULL; /* its result refused by the core's checks */
    if (!pending_type) return 0;
    PyObject *t = pending_type, *v = pending_value, *tb = pending_tb;
    pending_type = pending_value = pending_tb = NULL;
    if (!msg || !strstr(msg, "the callback scorer failed")) { /* a stale one: the failure is another's */
        Py_XDECREF(t), Py_XDECREF(v), Py_XDECREF(tb);
        return 0;
    }
    PyErr_Restore(t, v, tb);
    raised_last = 1;
    return 1;
}

/* A read-only array over the view's memory, holding it (strides in elements); None for NULL. */
static PyObject *view_array(PyObject *mem, const void *data, int type, int nd, const npy_intp *dims, const npy_intp *strides_el) {
    if (!data) Py_RETURN_NONE;
    npy_intp strides[4];
    const npy_intp item = type == NPY_FLOAT32 ? 4 : 8;
    for (int i = 0; i < nd; i++) strides[i] = strides_el[i] * item;
    PyObject *a = PyArray_New(&PyArray_Type, nd, (npy_intp *)dims, type, strides, (void *)data, 0, 0, NULL);
    if (a && PyArray_SetBaseObject((PyArrayObject *)a, Py_NewRef(mem)) < 0) Py_CLEAR(a);
    return a;
}

/* A copy of n values: what lives on the engine's stack or in its tables (lengths, RoPE frequencies). */
static PyObject *copy_array(const void *data, int type, npy_intp n) {
    PyObject *a = PyArray_SimpleNew(1, &n, type);
    if (a && n) memcpy(PyArray_DATA((PyArrayObject *)a), data, (size_t)n * PyArray_ITEMSIZE((PyArrayObject *)a));
    return a;
}

/* Keys or values as [n_kv_heads, max_len, head_dim] float32: the engine's host copy, or the store's rows themselves
 * when they are f32 in host memory, every head holds max_len rows and the heads lie at one stride; else None
 * (python_press.py pads the heads' views when the press reads the array). */
static PyObject *rows_array(PyObject *mem, const kvc_scorer_view *v, const float *copy, const void *const *lent) {
    const npy_intp Hkv = v->n_kv_heads, n = v->max_len, d = v->head_dim;
    const npy_intp dims[3] = {Hkv, n, d}, str[3] = {n * d, d, 1};
    if (copy) return view_array(mem, copy, NPY_FLOAT32, 3, dims, str);
    if (!lent || !v->rows_host || v->rows_dtype != KVC_ROWS_F32) Py_RETURN_NONE;
    const ptrdiff_t step = Hkv > 1 ? (const char *)lent[1] - (const char *)lent[0] : 0;
    for (npy_intp h = 0; h < Hkv; h++)
        if (v->len[h] != n || (const char *)lent[h] - (const char *)lent[0] != h * step) Py_RETURN_NONE;
    if (step % (ptrdiff_t)sizeof(float)) Py_RETURN_NONE;
    const npy_intp at_stride[3] = {(npy_intp)(step / (ptrdiff_t)sizeof(float)), d, 1};
    return view_array(mem, lent[0], NPY_FLOAT32, 3, dims, at_stride);
}

/* Each head's rows [len[h], head_dim] as DLViews: the store's own (as it keeps them: f32 or bf16, host or device
 * memory) when lent, else the host copy's; None when the view has neither. */
static PyObject *head_views(PyObject *mem, const kvc_scorer_view *v, const float *copy, const void *const *lent) {
    if (!copy && !lent) Py_RETURN_NONE;
    PyObject *t = PyTuple_New(v->n_kv_heads);
    for (int32_t h = 0; t && h < v->n_kv_heads; h++) {
        const int64_t shape[2] = {v->len[h], v->head_dim}, strides[2] = {v->head_dim, 1};
        PyObject *e = lent ? kvc_py_dlview_new(mem, lent[h], v->rows_dtype, v->rows_host, 2, shape, strides)
                           : kvc_py_dlview_new(mem, copy + (size_t)h * v->max_len * v->head_dim, KVC_ROWS_F32, 1, 2, shape,
                                               strides);
        if (!e) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, h, e);
    }
    return t;
}

static PyObject *layer_dict(PyObject *mem, const kvc_scorer_view *v) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    const npy_intp H = v->n_heads, dd = v->head_dim, n = v->max_len, w = v->window;
    const npy_intp q_dims[3] = {H, w, dd}, q_str[3] = {dd, H * dd, 1}; /* [w, H, d] in memory, [H, w, d] shown */
    const npy_intp h_dims[2] = {v->n_call, v->hidden_dim}, h_str[2] = {v->hidden_dim, 1};
    const npy_intp a_dims[3] = {H, w, n}, a_str[3] = {w * n, n, 1};
    const npy_intp p_dims[1] = {v->n_call}, one[1] = {1};
    SET_ITEM(d, "index", PyLong_FromLong(v->layer));
    SET_ITEM(d, "n_layers", PyLong_FromLong(v->n_layers));
    SET_ITEM(d, "n_heads", PyLong_FromLong(v->n_heads));
    SET_ITEM(d, "n_kv_heads", PyLong_FromLong(v->n_kv_heads));
    SET_ITEM(d, "head_dim", PyLong_FromLong(v->head_dim));
    SET_ITEM(d, "device", PyLong_FromLong(v->device));
    SET_ITEM(d, "window", PyLong_FromLong(v->window));
    SET_ITEM(d, "n_call", PyLong_FromLongLong(v->n_call));
    SET_ITEM(d, "max_len", PyLong_FromLongLong(v->max_len));
    SET_ITEM(d, "future_from", PyLong_FromLongLong(v->future_from));
    SET_ITEM(d, "lengths", copy_array(v->len, NPY_INT64, v->n_kv_heads));
    SET_ITEM(d, "keys", rows_array(mem, v, v->keys, v->key_rows));
    SET_ITEM(d, "values", rows_array(mem, v, v->values, v->value_rows));
    SET_ITEM(d, "key_rows", head_views(mem, v, v->keys, v->key_rows));
    SET_ITEM(d, "value_rows", head_views(mem, v, v->values, v->value_rows));
    SET_ITEM(d, "positions", view_array(mem, v->positions, NPY_INT64, 1, p_dims, one));
    SET_ITEM(d, "queries", view_array(mem, v->queries, NPY_FLOAT32, 3, q_dims, q_str));
    SET_ITEM(d, "hidden_states", view_array(mem, v->hidden, NPY_FLOAT32, 2, h_dims, h_str));
    SET_ITEM(d, "attentions", view_array(mem, v->attentions, NPY_FLOAT32, 3, a_dims, a_str));
    SET_ITEM(d, "rope_freqs", copy_array(v->rope_freq, NPY_FLOAT64, v->head_dim / 2));
    SET_ITEM(d, "rope_attn_factor", PyFloat_FromDouble(v->rope_attn_factor));
    SET_ITEM(d, "rope_pairing", PyUnicode_FromString(v->rope_pairing == KVC_ROPE_ADJACENT ? "adjacent" : "half"));
    return d;
}

/* scores: float32 or float64 [n_kv_heads, max_len] (or [n_kv_heads, len] when every head holds len rows). */
static int take_scores(const kvc_scorer_view *v, PyObject *res) {
    if (!PyArray_Check(res)) {
        PyErr_Format(PyExc_TypeError, "layer %d: score() must return a NumPy array (or a torch tensor), got %.100s", v->layer,
                     Py_TYPE(res)->tp_name);
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)res;
    const int t = PyArray_TYPE(a);
    if (t != NPY_FLOAT32 && t != NPY_FLOAT64) {
        PyErr_Format(PyExc_ValueError, "layer %d: score() returned %S scores, not float32 or float64", v->layer,
                     (PyObject *)PyArray_DESCR(a));
        return -1;
    }
    if (PyArray_NDIM(a) != 2 || PyArray_DIM(a, 0) != v->n_kv_heads || PyArray_DIM(a, 1) != v->max_len) {
        PyObject *shape = PyObject_GetAttrString(res, "shape");
        PyErr_Format(PyExc_ValueError, "layer %d: score() returned scores of shape %R, not (n_kv_heads, n) = (%d, %lld)",
                     v->layer, shape, v->n_kv_heads, (long long)v->max_len);
        Py_XDECREF(shape);
        return -1;
    }
    PyArrayObject *f = (PyArrayObject *)PyArray_FROMANY(res, NPY_FLOAT32, 2, 2, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_FORCECAST);
    if (!f) return -1;
    memcpy(v->scores, PyArray_DATA(f), sizeof(float) * (size_t)v->n_kv_heads * (size_t)v->max_len);
    Py_DECREF(f);
    return 0;
}

/* kept rows: a sequence of n_kv_heads 1-D integer arrays (range and repeats are the core's checks). */
static int take_keep(const kvc_scorer_view *v, PyObject *res) {
    PyObject *seq = PySequence_Fast(res, "compress() must return a sequence of kept-row arrays, one per KV head");
    if (!seq) return -1;
    int rc = 0;
    if (PySequence_Fast_GET_SIZE(seq) != v->n_kv_heads) {
        PyErr_Format(PyExc_ValueError, "layer %d: compress() returned %zd kept-row arrays for %d KV heads", v->layer,
                     PySequence_Fast_GET_SIZE(seq), v->n_kv_heads);
        rc = -1;
    }
    for (int32_t h = 0; h < v->n_kv_heads && rc == 0; h++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, h);
        PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(item, NPY_NOTYPE, 0, 0, 0);
        if (!a) { rc = -1; break; }
        if (PyArray_NDIM(a) != 1 || (PyArray_SIZE(a) > 0 && !PyArray_ISINTEGER(a))) {
            PyErr_Format(PyExc_ValueError, "layer %d, head %d: kept rows must be a 1-D array of integers", v->layer, h);
            Py_DECREF(a);
            rc = -1;
            break;
        }
        const npy_intp m = PyArray_SIZE(a);
        if (m > v->len[h]) {
            PyErr_Format(PyExc_ValueError, "layer %d, head %d: %zd kept rows of %lld", v->layer, h, (Py_ssize_t)m,
                         (long long)v->len[h]);
            Py_DECREF(a);
            rc = -1;
            break;
        }
        PyArrayObject *i64 = (PyArrayObject *)PyArray_FROMANY((PyObject *)a, NPY_INT64, 1, 1, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_FORCECAST);
        Py_DECREF(a);
        if (!i64) { rc = -1; break; }
        if (m) memcpy(v->keep + (size_t)h * v->max_len, PyArray_DATA(i64), sizeof(int64_t) * (size_t)m);
        v->n_keep[h] = m;
        Py_DECREF(i64);
    }
    Py_DECREF(seq);
    return rc;
}

static int32_t py_callback(void *user, const kvc_scorer_view *v) {
    PyGILState_STATE g = PyGILState_Ensure();
    int rc = -1;
    PyObject *mem = NULL, *d = NULL, *res = NULL;
    if (!dispatcher) {
        PyErr_SetString(PyExc_RuntimeError, "no Python press dispatcher registered (import kvpress_c)");
        goto done;
    }
    if (!(mem = kvc_py_view_memory_new()) || !(d = layer_dict(mem, v))) goto done;
    res = PyObject_CallFunction(dispatcher, "KiO", (unsigned long long)(uintptr_t)user, v->keep != NULL, d);
    if (!res) goto done;
    rc = v->keep ? take_keep(v, res) : take_scores(v, res);
done:
    if (rc != 0) {
        snprintf(v->message, (size_t)v->message_size, "a Python exception (raised again to the caller)");
        keep_pending(); /* its traceback may hold the view's arrays: they are kept below */
    }
    Py_XDECREF(d);
    Py_XDECREF(res);
    if (mem && Py_REFCNT(mem) > 1) { /* an array of the view outlives the call (kept by the press, an exception's
                                      * frames, a DLPack consumer): its memory must too */
        void *handle = kvc_scorer_view_retain(v);
        if (handle) {
            kvc_py_view_memory_keep(mem, handle);
        } else {
            snprintf(v->message, (size_t)v->message_size, "keeping its view past the call failed: %s", kvc_last_error());
            rc = -1;
        }
    }
    Py_XDECREF(mem);
    PyGILState_Release(g);
    return rc != 0;
}

static PyObject *scorer_callback_address(PyObject *m, PyObject *unused) {
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)&py_callback);
}

static PyObject *set_press_dispatcher(PyObject *m, PyObject *fn) {
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "set_press_dispatcher takes a callable");
        return NULL;
    }
    Py_INCREF(fn);
    Py_XSETREF(dispatcher, fn);
    Py_RETURN_NONE;
}

PyMethodDef kvc_py_pyscorer_methods[] = {
    {"scorer_callback_address", scorer_callback_address, METH_NOARGS,
     "The address of the module's kvc_scorer_callback: the \"callback\" setting of a Python press."},
    {"set_press_dispatcher", set_press_dispatcher, METH_O,
     "set_press_dispatcher(fn): fn(token, select, layer) runs a Python press's score() (select False) or compress()."},
    {NULL, NULL, 0, NULL}};
