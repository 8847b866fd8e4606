/* KVgrad: a chunk of the full cache scored by the gradient of the reconstruction loss. Session method kvgrad_score. */
#include "core.h"

static PyObject *kvgrad_score(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "start", "end", "n_sink", "grad_norms", NULL};
    PyArrayObject *ids = NULL, *out = NULL, *norms = NULL;
    long long start, end;
    int n_sink = 4, want_norms = 0, rc = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&LL|ip", kwlist, kvc_py_i32_ids, &ids, &start, &end, &n_sink,
                                     &want_norms))
        return NULL;
    if (kvc_py_check_session(self) < 0) goto done;
    if (end <= start) {
        PyErr_Format(PyExc_ValueError, "kvgrad_score: empty chunk [%lld, %lld)", start, end);
        goto done;
    }
    const kvc_config cfg = kvc_py_config(self);
    npy_intp dims[3] = {cfg.n_layers, cfg.n_kv_heads, (npy_intp)(end - start)}, gdims[2] = {cfg.n_layers, PyArray_DIM(ids, 0)};
    if (!(out = (PyArrayObject *)PyArray_SimpleNew(3, dims, NPY_FLOAT32))) goto done;
    if (want_norms && !(norms = (PyArrayObject *)PyArray_SimpleNew(2, gdims, NPY_FLOAT32))) goto done;
    KVC_PY_CALL(self, rc, kvc_session_kvgrad_score(self->session, (const int32_t *)PyArray_DATA(ids), PyArray_DIM(ids, 0),
                                                   start, end, n_sink, (float *)PyArray_DATA(out), (int64_t)PyArray_SIZE(out),
                                                   norms ? (float *)PyArray_DATA(norms) : NULL,
                                                   norms ? (int64_t)PyArray_SIZE(norms) : 0));
done:
    Py_DECREF(ids);
    if (rc < 0) {
        Py_XDECREF(out);
        Py_XDECREF(norms);
        return NULL;
    }
    if (!norms) return (PyObject *)out;
    return Py_BuildValue("(NN)", out, norms);
}

PyMethodDef kvc_py_kvgrad_methods[] = {
    {"kvgrad_score", (PyCFunction)(void (*)(void))kvgrad_score, METH_VARARGS | METH_KEYWORDS,
     "kvgrad_score(ids, start, end, n_sink=4, grad_norms=False) -> float32 [L, Hkv, end - start] (and with grad_norms\n"
     "the float32 [L, len(ids)] norms ||dPhi/da||): KVgrad's scores of the chunk [start, end) of the full cache from\n"
     "the reconstruction prompt ids (host forward and backward; the cache is not changed)."},
    {NULL, NULL, 0, NULL}};
