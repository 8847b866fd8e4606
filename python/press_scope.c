/* Session.set_press_scope / press_scope: what a prefill press sees of a layer on a session holding rows
 * (kvc_session_set_press_scope): "cache" (every row) or "call" (this call's rows; the earlier ones kept). */
#include "core.h"

static PyObject *set_press_scope(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (!name || (strcmp(name, "cache") != 0 && strcmp(name, "call") != 0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "press scope must be 'cache' or 'call'");
        return NULL;
    }
    return kvc_py_none(kvc_session_set_press_scope(self->session, strcmp(name, "call") == 0 ? KVC_PRESS_SCOPE_CALL
                                                                                            : KVC_PRESS_SCOPE_CACHE));
}

static PyObject *press_scope(SessionObject *self, PyObject *unused) {
    if (kvc_py_check_session(self) < 0) return NULL;
    return PyUnicode_FromString(kvc_session_press_scope(self->session) == KVC_PRESS_SCOPE_CALL ? "call" : "cache");
}

PyMethodDef kvc_py_press_scope_methods[] = {
    {"set_press_scope", (PyCFunction)set_press_scope, METH_O,
     "set_press_scope('cache' | 'call'): a prefill press on a session holding rows compresses every row ('cache',\n"
     "the default) or only the call's rows, the earlier ones kept as they are ('call')."},
    {"press_scope", (PyCFunction)press_scope, METH_NOARGS, "press_scope(): 'cache' or 'call'."},
    {NULL, NULL, 0, NULL}};
