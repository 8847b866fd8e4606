/* kvpress's wrappers over the attached press: ComposedPress (add_press), TADA's layer totals (set_layer_budgets),
 * and every press's arrays by name (set_press_array: PerLayerCompressionPress, DuoAttention, BlockPress,
 * KeyRerotationPress, ThinK, QFilter, ExpectedAttentionStats, LU-KV; _core.PRESS_ARRAYS lists them). */
#include "core.h"

static PyObject *add_press(SessionObject *self, PyObject *args, PyObject *kwds) {
    if (kvc_py_check_session(self) < 0) return NULL;
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "add_press takes keyword arguments (the fields of kvc_press_config)");
        return NULL;
    }
    kvc_press_spec *spec = kvc_py_press_spec_from(kwds);
    if (!spec) return NULL;
    int rc__;
    KVC_PY_CALL(self, rc__, kvc_session_chain_press(self->session, spec));
    PyObject *res = rc__ < 0 ? NULL : Py_NewRef(Py_None);
    kvc_press_spec_free(spec);
    return res;
}

/* A 1-D array of one dtype, whatever the caller passed (None on failure, with the exception). */
static PyArrayObject *vector(PyObject *arg, int type) {
    return (PyArrayObject *)PyArray_FROMANY(arg, type, 1, 1, NPY_ARRAY_C_CONTIGUOUS);
}

static PyObject *set_layer_budgets(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    PyArrayObject *a = vector(arg, NPY_INT64);
    if (!a) return NULL;
    int rc__;
    KVC_PY_CALL(self, rc__, kvc_session_set_layer_budgets(self->session, (const int64_t *)PyArray_DATA(a), (int32_t)PyArray_DIM(a, 0)));
    PyObject *res = rc__ < 0 ? NULL : Py_NewRef(Py_None);
    Py_DECREF(a);
    return res;
}

/* The numpy type of a press array's C type. */
static int npy_of(int32_t type) { return type == KVC_ARRAY_F64 ? NPY_FLOAT64 : type == KVC_ARRAY_I64 ? NPY_INT64 : NPY_FLOAT32; }

/* set_press_array(name, values): the array's row (kvc_press_array_info) gives its type; values of any shape whose
 * size is the array's count, converted to that type (a bool or int for a one-value array too). */
static PyObject *set_press_array(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"name", "values", NULL};
    const char *name;
    PyObject *values;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sO", kwlist, &name, &values)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    int32_t type = KVC_ARRAY_F32; /* an unknown name: the C setter says so */
    for (int32_t i = 0; i < kvc_press_array_count(); i++) {
        kvc_press_array_desc d;
        if (kvc_press_array_info(i, &d) == KVC_OK && strcmp(d.name, name) == 0) type = d.type;
    }
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(values, npy_of(type), 0, 4, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_FORCECAST);
    if (!a) return NULL;
    int rc__;
    KVC_PY_CALL(self, rc__, kvc_session_set_press_array(self->session, name, type, PyArray_DATA(a), (int64_t)PyArray_SIZE(a)));
    PyObject *res = rc__ < 0 ? NULL : Py_NewRef(Py_None);
    Py_DECREF(a);
    return res;
}

PyMethodDef kvc_py_wrapper_methods[] = {
    {"add_press", (PyCFunction)(void (*)(void))add_press, METH_VARARGS | METH_KEYWORDS,
     "add_press(scorer=..., ...): a press that compresses, layer by layer, what the attached press kept (ComposedPress)."},
    {"set_press_array", (PyCFunction)(void (*)(void))set_press_array, METH_VARARGS | METH_KEYWORDS,
     "set_press_array(name, values): an array of the last press of the chain by name (_core.PRESS_ARRAYS lists\n"
     "them with their types, shapes and meaning), e.g. set_press_array('block_size', 128)."},
    {"set_layer_budgets", (PyCFunction)set_layer_budgets, METH_O, "set_layer_budgets(totals[L]): per-layer totals (KVC_ALLOC_LAYER)."},
    {NULL, NULL, 0, NULL}};
