/* The K/V cache's storage type from Python (kvpress_c/kv_cache.py builds the (type, group, residual)
 * triple): Session.set_kv_format / kv_format here, Model's in model.c, one converter for both. */
#include "core.h"

/* O& converter: a (type, group, residual) tuple of ints into a kvc_kv_format. */
int kvc_py_kv_format(PyObject *obj, void *out) {
    kvc_kv_format *f = out;
    int type, group, residual;
    if (!PyTuple_Check(obj) || !PyArg_ParseTuple(obj, "iii", &type, &group, &residual)) {
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "a K/V cache format is a (type, group, residual) tuple of ints");
        }
        return 0;
    }
    f->type = type;
    f->group = group;
    f->residual = residual;
    return 1;
}

PyObject *kvc_py_kv_format_tuple(const kvc_kv_format *f) { return Py_BuildValue("(iii)", f->type, f->group, f->residual); }

static PyObject *Session_set_kv_format(SessionObject *self, PyObject *arg) {
    kvc_kv_format f;
    if (kvc_py_check_session(self) < 0 || !kvc_py_kv_format(arg, &f)) return NULL;
    int rc;
    KVC_PY_CALL(self, rc, kvc_session_set_kv_format(self->session, &f));
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Session_kv_format(SessionObject *self, PyObject *unused) {
    if (kvc_py_check_session(self) < 0) return NULL;
    kvc_kv_format f;
    kvc_session_get_kv_format(self->session, &f);
    return kvc_py_kv_format_tuple(&f);
}

PyMethodDef kvc_py_kv_cache_methods[] = {
    {"set_kv_format", (PyCFunction)Session_set_kv_format, METH_O,
     "set_kv_format((type, group, residual)): the K/V storage type of this empty session (kvpress_c.kv_cache)."},
    {"kv_format", (PyCFunction)Session_kv_format, METH_NOARGS,
     "(type, group, residual) the session's stores hold (the device's native type resolved)."},
    {NULL, NULL, 0, NULL}};
