/* Presses written in Python inside the engine: the module's kvc_scorer_callback (kvpress_c.h). A Python press's
 * config names this function by its address ("callback", from scorer_callback_address()) and itself by a token
 * ("callback_user"); the engine calls it for every layer it compresses, on the thread of the forward, with the
 * GIL released. It takes the GIL for the Python call only: the view's arrays as read-only NumPy arrays over the
 * engine's host memory (valid during the call), handed to the dispatcher kvpress_c registered
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

/* A read-only array over the engine's memory (no copy), strides in elements; None for NULL. */
static PyObject *view_array(const void *data, int type, int nd, const npy_intp *dims, const npy_intp *strides_el) {
    if (!data) Py_RETURN_NONE;
    npy_intp strides[4];
    const npy_intp item = type == NPY_FLOAT32 ? 4 : 8;
    for (int i = 0; i < nd; i++) strides[i] = strides_el[i] * item;
    return PyArray_New(&PyArray_Type, nd, (npy_intp *)dims, type, strides, (void *)data, 0, 0, NULL);
}

static PyObject *layer_dict(const kvc_scorer_view *v) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    const npy_intp Hkv = v->n_kv_heads, H = v->n_heads, dd = v->head_dim, n = v->max_len, w = v->window;
    const npy_intp kv_dims[3] = {Hkv, n, dd}, kv_str[3] = {n * dd, dd, 1};
    const npy_intp q_dims[3] = {H, w, dd}, q_str[3] = {dd, H * dd, 1}; /* [w, H, d] in memory, [H, w, d] shown */
    const npy_intp h_dims[2] = {v->n_call, v->hidden_dim}, h_str[2] = {v->hidden_dim, 1};
    const npy_intp a_dims[3] = {H, w, n}, a_str[3] = {w * n, n, 1};
    const npy_intp l_dims[1] = {Hkv}, p_dims[1] = {v->n_call}, one[1] = {1};
    SET_ITEM(d, "index", PyLong_FromLong(v->layer));
    SET_ITEM(d, "n_layers", PyLong_FromLong(v->n_layers));
    SET_ITEM(d, "n_heads", PyLong_FromLong(v->n_heads));
    SET_ITEM(d, "n_kv_heads", PyLong_FromLong(v->n_kv_heads));
    SET_ITEM(d, "head_dim", PyLong_FromLong(v->head_dim));
    SET_ITEM(d, "device", PyLong_FromLong(v->device));
    SET_ITEM(d, "window", PyLong_FromLong(v->window));
    SET_ITEM(d, "n_call", PyLong_FromLongLong(v->n_call));
    SET_ITEM(d, "future_from", PyLong_FromLongLong(v->future_from));
    SET_ITEM(d, "lengths", view_array(v->len, NPY_INT64, 1, l_dims, one));
    SET_ITEM(d, "keys", view_array(v->keys, NPY_FLOAT32, 3, kv_dims, kv_str));
    SET_ITEM(d, "values", view_array(v->values, NPY_FLOAT32, 3, kv_dims, kv_str));
    SET_ITEM(d, "positions", view_array(v->positions, NPY_INT64, 1, p_dims, one));
    SET_ITEM(d, "queries", view_array(v->queries, NPY_FLOAT32, 3, q_dims, q_str));
    SET_ITEM(d, "hidden_states", view_array(v->hidden, NPY_FLOAT32, 2, h_dims, h_str));
    SET_ITEM(d, "attentions", view_array(v->attentions, NPY_FLOAT32, 3, a_dims, a_str));
    const npy_intp f_dims[1] = {v->head_dim / 2};
    SET_ITEM(d, "rope_freqs", view_array(v->rope_freq, NPY_FLOAT64, 1, f_dims, one));
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
    PyObject *d = NULL, *res = NULL;
    if (!dispatcher) {
        PyErr_SetString(PyExc_RuntimeError, "no Python press dispatcher registered (import kvpress_c)");
        goto done;
    }
    if (!(d = layer_dict(v))) goto done;
    res = PyObject_CallFunction(dispatcher, "KiO", (unsigned long long)(uintptr_t)user, v->keep != NULL, d);
    if (!res) goto done;
    rc = v->keep ? take_keep(v, res) : take_scores(v, res);
done:
    if (rc != 0) {
        snprintf(v->message, (size_t)v->message_size, "a Python exception (raised again to the caller)");
        keep_pending();
    }
    Py_XDECREF(d);
    Py_XDECREF(res);
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
