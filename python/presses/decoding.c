/* DecodingPress: compression while decoding. Session method set_decoding_press (its query statistics:
 * expected_attention.c). */
#include "core.h"

/* The device's lock is taken with the GIL released (KVC_PY_CALL): a forward in another thread may be waiting for
 * the GIL inside a Python press while it holds that lock. */
static PyObject *set_decoding_press(SessionObject *self, PyObject *args, PyObject *kwds) {
    int rc__;
    if (kvc_py_check_session(self) < 0) return NULL;
    if (PyTuple_GET_SIZE(args) == 1 && PyTuple_GET_ITEM(args, 0) == Py_None && (!kwds || PyDict_GET_SIZE(kwds) == 0)) {
        KVC_PY_CALL(self, rc__, kvc_session_set_decoding_press(self->session, NULL));
        return rc__ < 0 ? NULL : Py_NewRef(Py_None);
    }
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "set_decoding_press takes None or keyword arguments (kvc_decoding_config fields "
                                         "and the base press's settings)");
        return NULL;
    }
    kvc_decoding_config *c = kvc_py_decoding_config(kwds);
    if (!c) return NULL;
    KVC_PY_CALL(self, rc__, kvc_session_set_decoding_press(self->session, c));
    PyObject *res = rc__ < 0 ? NULL : Py_NewRef(Py_None);
    kvc_decoding_config_free(c);
    return res;
}

PyMethodDef kvc_py_decoding_methods[] = {
    {"set_decoding_press", (PyCFunction)(void (*)(void))set_decoding_press, METH_VARARGS | METH_KEYWORDS,
     "set_decoding_press(None) or set_decoding_press(compression_interval=..., target_size=..., ratio_target=...,\n"
     "target_compression_ratio=..., hidden_states_buffer_size=..., scorer=..., ...): compress while decoding."},
    {NULL, NULL, 0, NULL}};
