/* What the attached press recorded at its last compression: scores (record_scores), Ada-KV's eviction loss,
 * a layer's error statistics. Session methods press_scores, press_error, press_layer_stats. */
#include "core.h"

static PyObject *press_scores(SessionObject *self, PyObject *args) {
    int layer, head;
    if (!PyArg_ParseTuple(args, "ii", &layer, &head)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    int64_t n = 0;
    kvc_status st = kvc_session_press_scores(self->session, layer, head, NULL, &n);
    if (st != KVC_OK) return kvc_py_raise(st);
    npy_intp dims[1] = {n};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_FLOAT32);
    if (!out) return NULL;
    st = kvc_session_press_scores(self->session, layer, head, (float *)PyArray_DATA(out), &n);
    if (st != KVC_OK) {
        Py_DECREF(out);
        return kvc_py_raise(st);
    }
    return (PyObject *)out;
}

static PyObject *press_error(SessionObject *self, PyObject *args) {
    int layer;
    if (!PyArg_ParseTuple(args, "i", &layer)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    double e;
    kvc_status st = kvc_session_press_error(self->session, layer, &e);
    if (st != KVC_OK) return kvc_py_raise(st);
    return PyFloat_FromDouble(e);
}

static PyObject *press_layer_stats(SessionObject *self, PyObject *args) {
    int layer;
    if (!PyArg_ParseTuple(args, "i", &layer)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    double e, dis;
    kvc_status st = kvc_session_press_layer_stats(self->session, layer, &e, &dis);
    if (st != KVC_OK) return kvc_py_raise(st);
    return Py_BuildValue("(dd)", e, dis);
}

PyMethodDef kvc_py_diagnostics_methods[] = {
    {"press_scores", (PyCFunction)press_scores, METH_VARARGS, "press_scores(layer, kv_head): scores of the last compression (record_scores)."},
    {"press_error", (PyCFunction)press_error, METH_VARARGS, "press_error(layer): Ada-KV eviction loss on the window queries."},
    {"press_layer_stats", (PyCFunction)press_layer_stats, METH_VARARGS, "press_layer_stats(layer) -> (E_internal, 1 - cos(R, R+O))."},
    {NULL, NULL, 0, NULL}};
