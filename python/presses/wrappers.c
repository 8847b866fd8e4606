/* kvpress's wrappers over the attached press: ComposedPress (add_press), PerLayerCompressionPress
 * (set_layer_ratios), TADA's layer totals (set_layer_budgets), KeyRerotationPress (set_key_rerotation),
 * DuoAttention (set_head_budgets), BlockPress (set_block_size), ThinK (set_key_channels). */
#include "core.h"

static PyObject *add_press(SessionObject *self, PyObject *args, PyObject *kwds) {
    if (kvc_py_check_session(self) < 0) return NULL;
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "add_press takes keyword arguments (the fields of kvc_press_config)");
        return NULL;
    }
    kvc_press_spec *spec = kvc_py_press_spec_from(kwds);
    if (!spec) return NULL;
    PyObject *res = kvc_py_none(kvc_session_chain_press(self->session, spec));
    kvc_press_spec_free(spec);
    return res;
}

/* A 1-D array of one dtype, whatever the caller passed (None on failure, with the exception). */
static PyArrayObject *vector(PyObject *arg, int type) {
    return (PyArrayObject *)PyArray_FROMANY(arg, type, 1, 1, NPY_ARRAY_C_CONTIGUOUS);
}

static PyObject *set_layer_ratios(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    PyArrayObject *r = vector(arg, NPY_FLOAT64);
    if (!r) return NULL;
    PyObject *res = kvc_py_none(
        kvc_session_set_layer_ratios(self->session, (const double *)PyArray_DATA(r), (int32_t)PyArray_DIM(r, 0)));
    Py_DECREF(r);
    return res;
}

static PyObject *set_layer_budgets(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    PyArrayObject *a = vector(arg, NPY_INT64);
    if (!a) return NULL;
    PyObject *res = kvc_py_none(
        kvc_session_set_layer_budgets(self->session, (const int64_t *)PyArray_DATA(a), (int32_t)PyArray_DIM(a, 0)));
    Py_DECREF(a);
    return res;
}

static PyObject *set_key_rerotation(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    return kvc_py_none(kvc_session_set_key_rerotation(self->session, on));
}

static PyObject *set_head_budgets(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    PyArrayObject *k = (PyArrayObject *)PyArray_FROMANY(arg, NPY_INT64, 1, 2, NPY_ARRAY_C_CONTIGUOUS);
    if (!k) return NULL;
    PyObject *res = kvc_py_none(
        kvc_session_set_head_budgets(self->session, (const int64_t *)PyArray_DATA(k), (int64_t)PyArray_SIZE(k)));
    Py_DECREF(k);
    return res;
}

static PyObject *set_block_size(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    const long long b = PyLong_AsLongLong(arg);
    if (b == -1 && PyErr_Occurred()) return NULL;
    return kvc_py_none(kvc_session_set_block_size(self->session, b));
}

static PyObject *set_key_channels(SessionObject *self, PyObject *args) {
    double ratio;
    int window, free_channels = 1;
    if (!PyArg_ParseTuple(args, "di|p", &ratio, &window, &free_channels)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    return kvc_py_none(kvc_session_set_key_channels(self->session, ratio, window, free_channels));
}

PyMethodDef kvc_py_wrapper_methods[] = {
    {"add_press", (PyCFunction)(void (*)(void))add_press, METH_VARARGS | METH_KEYWORDS,
     "add_press(scorer=..., ...): a press that compresses, layer by layer, what the attached press kept (ComposedPress)."},
    {"set_layer_ratios", (PyCFunction)set_layer_ratios, METH_O,
     "set_layer_ratios(ratios[L]): each layer's compression_ratio for the attached press (PerLayerCompressionPress)."},
    {"set_key_rerotation", (PyCFunction)set_key_rerotation, METH_O,
     "set_key_rerotation(on): the attached press re-rotates kept keys to positions 0 .. n_kept - 1 (KeyRerotationPress)."},
    {"set_head_budgets", (PyCFunction)set_head_budgets, METH_O,
     "set_head_budgets(keep[L, Hkv]): rows each head keeps (-1: all) instead of the press budget (DuoAttention)."},
    {"set_block_size", (PyCFunction)set_block_size, METH_O,
     "set_block_size(b): the attached press selects block by block (BlockPress); 0 turns it off."},
    {"set_key_channels", (PyCFunction)set_key_channels, METH_VARARGS,
     "set_key_channels(ratio, window, free_channels=True): ThinK key-channel pruning by the attached press\n"
     "(free_channels: pruned keys stored with the kept channels only; False: channels zeroed in place)."},
    {"set_layer_budgets", (PyCFunction)set_layer_budgets, METH_O, "set_layer_budgets(totals[L]): per-layer totals (KVC_ALLOC_LAYER)."},
    {NULL, NULL, 0, NULL}};
