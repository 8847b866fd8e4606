/* ExpectedAttention with given query statistics (ExpectedAttentionStatsPress, and the decoding press whose
 * base it is), and the query moments that make them. Session methods set_decoding_query_stats,
 * query_moments (the prefill press's statistics are its arrays: set_press_array). */
#include "core.h"

typedef kvc_status (*query_stats_fn)(kvc_session *, const float *, const float *, int64_t, int64_t);

/* (mean[L, H, d], cov[L, H, d, d]) handed to fn as float32 */
static PyObject *query_stats_call(SessionObject *self, PyObject *args, query_stats_fn fn) {
    PyObject *mo, *co;
    if (!PyArg_ParseTuple(args, "OO", &mo, &co)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    PyArrayObject *m = (PyArrayObject *)PyArray_FROMANY(mo, NPY_FLOAT32, 1, 3, NPY_ARRAY_C_CONTIGUOUS);
    if (!m) return NULL;
    PyArrayObject *c = (PyArrayObject *)PyArray_FROMANY(co, NPY_FLOAT32, 1, 4, NPY_ARRAY_C_CONTIGUOUS);
    PyObject *res = c ? kvc_py_none(fn(self->session, (const float *)PyArray_DATA(m), (const float *)PyArray_DATA(c),
                                       (int64_t)PyArray_SIZE(m), (int64_t)PyArray_SIZE(c)))
                      : NULL;
    Py_DECREF(m);
    Py_XDECREF(c);
    return res;
}

static PyObject *set_decoding_query_stats(SessionObject *self, PyObject *args) {
    return query_stats_call(self, args, kvc_session_set_decoding_query_stats);
}

/* query_moments(ids, n_sink=4) -> (sum [L, H, d], outer [L, H, d, d]) float64 */
static PyObject *query_moments(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "n_sink", NULL};
    PyArrayObject *ids = NULL, *sum = NULL, *outer = NULL;
    int n_sink = 4, rc = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|i", kwlist, kvc_py_i32_ids, &ids, &n_sink)) return NULL;
    if (kvc_py_check_session(self) < 0) goto done;
    const kvc_config cfg = kvc_py_config(self);
    npy_intp dims[4] = {cfg.n_layers, cfg.n_heads, cfg.head_dim, cfg.head_dim};
    if (!(sum = (PyArrayObject *)PyArray_ZEROS(3, dims, NPY_FLOAT64, 0))) goto done;
    if (!(outer = (PyArrayObject *)PyArray_ZEROS(4, dims, NPY_FLOAT64, 0))) goto done;
    KVC_PY_CALL(self, rc, kvc_session_query_moments(self->session, (const int32_t *)PyArray_DATA(ids), PyArray_DIM(ids, 0),
                                                    n_sink, (double *)PyArray_DATA(sum), (int64_t)PyArray_SIZE(sum),
                                                    (double *)PyArray_DATA(outer), (int64_t)PyArray_SIZE(outer)));
done:
    Py_DECREF(ids);
    if (rc < 0) {
        Py_XDECREF(sum);
        Py_XDECREF(outer);
        return NULL;
    }
    return Py_BuildValue("(NN)", sum, outer);
}

PyMethodDef kvc_py_expected_attention_methods[] = {
    {"set_decoding_query_stats", (PyCFunction)set_decoding_query_stats, METH_VARARGS,
     "set_decoding_query_stats(mean[L, H, d], cov[L, H, d, d]): the same for the decoding press (its base an\n"
     "ExpectedAttention press): the given statistics instead of the buffered queries'."},
    {"query_moments", (PyCFunction)(void (*)(void))query_moments, METH_VARARGS | METH_KEYWORDS,
     "query_moments(ids, n_sink=4) -> (sum[L, H, d], outer[L, H, d, d]): the pre-RoPE queries after the first n_sink\n"
     "of a forward of ids on this empty session, summed and their products summed (float64); the session is reset."},
    {NULL, NULL, 0, NULL}};
