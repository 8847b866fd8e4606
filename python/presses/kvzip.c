/* KVzip (and RestoreKV's prefix eviction): the context rows scored by reconstruction, then the whole cache
 * evicted at once. Session methods kvzip_score, kvzip_evict. */
#include "core.h"

static PyObject *kvzip_score(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "start", "end", "n_sink", "plus", NULL};
    PyArrayObject *ids = NULL;
    long long start, end;
    int n_sink = 4, plus = 0, rc;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&LL|ip", kwlist, kvc_py_i32_ids, &ids, &start, &end, &n_sink, &plus))
        return NULL;
    PyArrayObject *out = NULL;
    if (kvc_py_check_session(self) < 0) goto done;
    if (end <= start) {
        PyErr_Format(PyExc_ValueError, "kvzip_score: empty chunk [%lld, %lld)", start, end);
        goto done;
    }
    const kvc_config cfg = kvc_py_config(self);
    npy_intp dims[3] = {cfg.n_layers, cfg.n_kv_heads, (npy_intp)(end - start)};
    if (!(out = (PyArrayObject *)PyArray_SimpleNew(3, dims, NPY_FLOAT32))) goto done;
    KVC_PY_CALL(self, rc, kvc_session_kvzip_score(self->session, (const int32_t *)PyArray_DATA(ids), PyArray_DIM(ids, 0),
                                                  start, end, n_sink, plus, (float *)PyArray_DATA(out),
                                                  (int64_t)PyArray_SIZE(out)));
    if (rc < 0) Py_CLEAR(out);
done:
    Py_DECREF(ids);
    return (PyObject *)out;
}

static PyObject *kvzip_evict(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"scores", "compression_ratio", "layerwise", "n_sink", "first", NULL};
    PyArrayObject *sc = NULL;
    double ratio;
    long long first = 0;
    int layerwise = 0, n_sink = 4, rc = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&d|piL", kwlist, kvc_py_f32_array, &sc, &ratio, &layerwise, &n_sink,
                                     &first))
        return NULL;
    if (kvc_py_check_session(self) < 0) goto done;
    const kvc_config cfg = kvc_py_config(self);
    const int64_t n = kvc_session_position(self->session), n_pos = PyArray_NDIM(sc) == 3 ? PyArray_DIM(sc, 2) : 0;
    if (PyArray_NDIM(sc) != 3 || PyArray_DIM(sc, 0) != cfg.n_layers || PyArray_DIM(sc, 1) != cfg.n_kv_heads || n_pos < 1 ||
        first < 0 || n_pos > n - first) {
        PyErr_Format(PyExc_ValueError, "kvzip_evict: scores must have shape (%d, %d, n) with first (%lld) + n <= %lld, the "
                     "session's position", cfg.n_layers, cfg.n_kv_heads, first, (long long)n);
        goto done;
    }
    const float *s = (const float *)PyArray_DATA(sc);
    const int64_t n_scores = (int64_t)PyArray_SIZE(sc);
    /* every position scored: KVzip's eviction of the cache; else those positions' rows only (the rest stay) */
    KVC_PY_CALL(self, rc, first == 0 && n_pos == n
                              ? kvc_session_kvzip_evict(self->session, s, n_scores, ratio, layerwise, n_sink)
                              : kvc_session_kvzip_evict_range(self->session, s, n_scores, first, n_pos, ratio, layerwise, n_sink));
done:
    Py_DECREF(sc);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

PyMethodDef kvc_py_kvzip_methods[] = {
    {"kvzip_score", (PyCFunction)(void (*)(void))kvzip_score, METH_VARARGS | METH_KEYWORDS,
     "kvzip_score(ids, start, end, n_sink=4, plus=False) -> float32 [L, Hkv, end - start]: KVzip's scores of the\n"
     "rows held at positions [start, end) (by position - start; 0 where a head holds none) from the reconstruction\n"
     "tokens ids, run on the session's cache, full or compressed (their rows are dropped again)."},
    {"kvzip_evict", (PyCFunction)(void (*)(void))kvzip_evict, METH_VARARGS | METH_KEYWORDS,
     "kvzip_evict(scores[L, Hkv, n], compression_ratio, layerwise=False, n_sink=4, first=0): KVzip's eviction of\n"
     "the rows held at positions [first, first + n) (scores by position - first; the other rows stay): of the C rows\n"
     "held there, the int(C ratio) lowest go; compression_ratio in [0, 1) for every position, [0, 1] for a range."},
    {NULL, NULL, 0, NULL}};
