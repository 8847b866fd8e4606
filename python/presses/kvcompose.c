/* KVCompose: attention statistics over the prompt, then a structured eviction of the full cache.
 * Session methods kvcompose_profile, kvcompose_evict. */
#include "core.h"

static PyObject *kvcompose_profile(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "sum", NULL};
    PyArrayObject *ids = NULL, *out = NULL;
    int sum = 0, rc;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|p", kwlist, kvc_py_i32_ids, &ids, &sum)) return NULL;
    if (kvc_py_check_session(self) < 0) goto done;
    const kvc_config cfg = kvc_py_config(self);
    npy_intp dims[3] = {cfg.n_layers, cfg.n_heads, (npy_intp)kvc_session_position(self->session)};
    if (!(out = (PyArrayObject *)PyArray_SimpleNew(3, dims, NPY_FLOAT32))) goto done;
    KVC_PY_CALL(self, rc, kvc_session_kvcompose_profile(self->session, (const int32_t *)PyArray_DATA(ids), PyArray_DIM(ids, 0),
                                                        sum, (float *)PyArray_DATA(out), (int64_t)PyArray_SIZE(out)));
    if (rc < 0) Py_CLEAR(out);
done:
    Py_DECREF(ids);
    return (PyObject *)out;
}

static PyObject *kvcompose_evict(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"task", "compression_ratio", "structured", "group_max", "head_max", "add_v_norm",
                             "add_mean", "lower_bound", NULL};
    PyArrayObject *sc = NULL;
    double ratio;
    int structured = 1, group_max = 0, head_max = 0, add_v_norm = 0, add_mean = 1, rc = -1;
    long long lower_bound = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&d|pppppL", kwlist, kvc_py_f32_array, &sc, &ratio, &structured,
                                     &group_max, &head_max, &add_v_norm, &add_mean, &lower_bound))
        return NULL;
    if (kvc_py_check_session(self) < 0) goto done;
    const kvc_config cfg = kvc_py_config(self);
    if (kvc_py_shape(sc, "kvcompose_evict: task scores", 3, (npy_intp)cfg.n_layers, (npy_intp)cfg.n_heads,
                     (npy_intp)kvc_session_position(self->session)) < 0)
        goto done;
    KVC_PY_CALL(self, rc, kvc_session_kvcompose_evict(self->session, (const float *)PyArray_DATA(sc), (int64_t)PyArray_SIZE(sc), ratio, structured,
                                                      group_max, head_max, add_v_norm, add_mean, lower_bound));
done:
    Py_DECREF(sc);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

PyMethodDef kvc_py_kvcompose_methods[] = {
    {"kvcompose_profile", (PyCFunction)(void (*)(void))kvcompose_profile, METH_VARARGS | METH_KEYWORDS,
     "kvcompose_profile(ids, sum=False) -> float32 [L, H, n]: per attention head and context row, the maximum (or sum)\n"
     "over the prompt ids' queries, run on the full context cache, of their attention (KVCompose's statistics)."},
    {"kvcompose_evict", (PyCFunction)(void (*)(void))kvcompose_evict, METH_VARARGS | METH_KEYWORDS,
     "kvcompose_evict(task[L, H, n], compression_ratio, structured=True, group_max=False, head_max=False,\n"
     "add_v_norm=False, add_mean=True, lower_bound=0): KVCompose's eviction of the full context cache."},
    {NULL, NULL, 0, NULL}};
