/* TAKE: chunked prefill with probe queries. Session method prefill_take. */
#include "core.h"

static PyObject *prefill_take(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "probe_ids", "budget", "chunk_size", "warmup_budget", "warmup_layers", "kernel",
                             "alpha", "delayed", "inner", "prompt_cached", NULL};
    PyArrayObject *ids = NULL, *probe = NULL, *logits = NULL;
    PyObject *inner = Py_None;
    kvc_press_spec *spec = NULL;
    kvc_take_config c;
    kvc_take_config_defaults(&c);
    long long budget, chunk = c.chunk_size, warm = 0;
    int rc = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O&L|LLiifpOp", kwlist, kvc_py_i32_ids, &ids, kvc_py_i32_ids, &probe,
                                     &budget, &chunk, &warm, &c.warmup_layers, &c.kernel, &c.alpha, &c.delayed, &inner,
                                     &c.prompt_cached))
        return NULL;
    if (kvc_py_check_session(self) < 0) goto done;
    c.budget = budget;
    c.chunk_size = chunk;
    c.warmup_budget = warm;
    if (inner != Py_None) { /* the inner scorer, as set_press keywords */
        if (!PyDict_Check(inner)) {
            PyErr_SetString(PyExc_TypeError, "inner must be a dict of press settings");
            goto done;
        }
        if (!(spec = kvc_py_press_spec_from(inner))) goto done;
        c.inner = spec;
    }
    c.probe_ids = (const int32_t *)PyArray_DATA(probe);
    c.n_probe = PyArray_DIM(probe, 0);
    npy_intp dims[1] = {kvc_py_config(self).vocab};
    /* no logits when prompt_cached: the shared prefill gave them */
    if (!c.prompt_cached && !(logits = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_FLOAT32))) goto done;
    KVC_PY_CALL(self, rc, kvc_session_prefill_take(self->session, (const int32_t *)PyArray_DATA(ids), PyArray_DIM(ids, 0),
                                                   &c, logits ? (float *)PyArray_DATA(logits) : NULL));
done:
    kvc_press_spec_free(spec);
    Py_DECREF(ids);
    Py_DECREF(probe);
    if (rc < 0) {
        Py_XDECREF(logits);
        return NULL;
    }
    if (!logits) Py_RETURN_NONE;
    return (PyObject *)logits;
}

PyMethodDef kvc_py_take_methods[] = {
    {"prefill_take", (PyCFunction)(void (*)(void))prefill_take, METH_VARARGS | METH_KEYWORDS,
     "prefill_take(ids, probe_ids, budget, chunk_size=4096, warmup_budget=0, warmup_layers=-1, kernel=7,\n"
     "alpha=0.2, delayed=True, inner=None, prompt_cached=False): TAKE chunked prefill; returns the last token's\n"
     "logits. prompt_cached: the session holds the prompt's full cache (one chunk): run only the probes, evict\n"
     "and return None."},
    {NULL, NULL, 0, NULL}};
