/* kvpress_c._core.PressSpec: a press's settings by name over the C ABI's kvc_press_spec ("Presses by name" in
 * kvpress_c.h). Settings read and set as attributes or items (set_one's conversion rules, press_args.c), the
 * one C check, the budget rule; Session.attach_press takes it, and Session.set_press goes the same way. */
#include "core.h"
#include <math.h>
#include <string.h>

/* The row of the settings table named `name`; 0, or -1 (TypeError when `raise`, else nothing set). */
static int param_info(PyObject *name, kvc_param_info *p, const char **cname, int raise) {
    const char *n = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    if (!n) {
        if (PyErr_Occurred()) {
            if (!raise) PyErr_Clear();
        } else if (raise)
            PyErr_SetString(PyExc_TypeError, "press settings are named by str");
        return -1;
    }
    const int32_t i = kvc_press_param_index(n);
    if (i < 0 || kvc_press_param_info(i, p) != KVC_OK) {
        if (raise) PyErr_Format(PyExc_TypeError, "'%s' is not a press setting (kvpress_c.press_params() lists them)", n);
        return -1;
    }
    *cname = n;
    return 0;
}

/* A setting's value as Python: int, bool, float, or a choice's name. */
static PyObject *value_of(const kvc_param_info *p, double v) {
    if (!strcmp(p->type, "choice")) {
        const int32_t c = (int32_t)v;
        if (c < 0 || c >= p->n_choices) return PyLong_FromLong(c);
        return PyUnicode_FromString(p->choices[c]);
    }
    if (!strcmp(p->type, "bool")) return PyBool_FromLong(v != 0);
    if (!strcmp(p->type, "int")) return PyLong_FromLongLong((long long)v);
    if (!strcmp(p->type, "uint")) return PyLong_FromUnsignedLongLong((unsigned long long)v);
    return PyFloat_FromDouble(v);
}

static PyObject *get_setting(PressSpecObject *self, PyObject *name, int raise) {
    kvc_param_info p;
    const char *n;
    if (param_info(name, &p, &n, raise) < 0) return NULL;
    double v;
    kvc_status st = kvc_press_spec_get(self->spec, n, &v);
    if (st != KVC_OK) return kvc_py_raise(st);
    return value_of(&p, v);
}

static PyObject *PressSpec_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PressSpecObject *self = (PressSpecObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    kvc_status st = kvc_press_spec_new(NULL, &self->spec);
    if (st != KVC_OK) {
        Py_DECREF(self);
        return kvc_py_raise(st);
    }
    return (PyObject *)self;
}

/* PressSpec(scorer=None, **settings): kvpress's defaults, then the scorer, then the settings */
static int PressSpec_init(PressSpecObject *self, PyObject *args, PyObject *kwds) {
    PyObject *scorer = Py_None;
    if (!PyArg_ParseTuple(args, "|O:PressSpec", &scorer)) return -1;
    if (scorer != Py_None && kwds && PyDict_GetItemString(kwds, "scorer")) {
        PyErr_SetString(PyExc_TypeError, "PressSpec() got the scorer twice");
        return -1;
    }
    kvc_press_spec *spec = kvc_py_press_spec_from(NULL);
    if (!spec) return -1;
    PyObject *key = PyUnicode_FromString("scorer");
    int r = key ? 0 : -1;
    if (r == 0 && scorer != Py_None) r = kvc_py_press_spec_set(spec, key, scorer);
    Py_XDECREF(key);
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (r == 0 && kwds && PyDict_Next(kwds, &pos, &k, &v)) r = kvc_py_press_spec_set(spec, k, v);
    if (r < 0) {
        kvc_press_spec_free(spec);
        return -1;
    }
    kvc_press_spec_free(self->spec);
    self->spec = spec;
    return 0;
}

static void PressSpec_dealloc(PressSpecObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    kvc_press_spec_free(self->spec);
    self->spec = NULL;
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* Attributes: a setting's name reads or sets it; anything else is an ordinary attribute (the methods). */
static PyObject *PressSpec_getattro(PressSpecObject *self, PyObject *name) {
    kvc_param_info p;
    const char *n;
    if (param_info(name, &p, &n, 0) == 0) return get_setting(self, name, 1);
    return PyObject_GenericGetAttr((PyObject *)self, name);
}

static int PressSpec_setattro(PressSpecObject *self, PyObject *name, PyObject *value) {
    if (!value) {
        PyErr_SetString(PyExc_TypeError, "press settings cannot be deleted (set the default instead)");
        return -1;
    }
    return kvc_py_press_spec_set(self->spec, name, value);
}

static PyObject *PressSpec_getitem(PressSpecObject *self, PyObject *name) { return get_setting(self, name, 1); }

static int PressSpec_setitem(PressSpecObject *self, PyObject *name, PyObject *value) {
    return PressSpec_setattro(self, name, value);
}

static PyObject *PressSpec_get(PressSpecObject *self, PyObject *name) { return get_setting(self, name, 1); }

static PyObject *PressSpec_check(PressSpecObject *self, PyObject *unused) {
    return kvc_py_none(kvc_press_spec_check(self->spec));
}

/* kept(n, layer=0, n_layers=1) -> tokens a KV head of n rows keeps at that layer */
static PyObject *PressSpec_kept(PressSpecObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"n", "layer", "n_layers", NULL};
    long long n;
    int layer = 0, n_layers = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|ii:kept", kwlist, &n, &layer, &n_layers)) return NULL;
    int64_t out = 0;
    kvc_status st = kvc_press_spec_kept(self->spec, layer, n_layers, n, &out);
    if (st != KVC_OK) return kvc_py_raise(st);
    return PyLong_FromLongLong(out);
}

/* settings() -> {name: value} of every setting; `changed`: only those that differ from the default */
static PyObject *settings_dict(PressSpecObject *self, int changed) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    for (int32_t i = 0; i < kvc_press_param_count(); i++) {
        kvc_param_info p;
        double v;
        kvc_status st = kvc_press_param_info(i, &p);
        if (st == KVC_OK) st = kvc_press_spec_get(self->spec, p.name, &v);
        if (st != KVC_OK) {
            Py_DECREF(d);
            return kvc_py_raise(st);
        }
        if (changed && (v == p.default_value || (isnan(v) && isnan(p.default_value)))) continue;
        SET_ITEM(d, p.name, value_of(&p, v));
    }
    return d;
}

static PyObject *PressSpec_settings(PressSpecObject *self, PyObject *unused) { return settings_dict(self, 0); }

static PyObject *PressSpec_repr(PressSpecObject *self) {
    PyObject *d = settings_dict(self, 1);
    if (!d) return NULL;
    PyObject *parts = PyList_New(0), *key, *value;
    Py_ssize_t pos = 0;
    while (parts && PyDict_Next(d, &pos, &key, &value)) {
        PyObject *s = PyUnicode_FromFormat("%U=%R", key, value);
        if (!s || PyList_Append(parts, s) < 0) Py_CLEAR(parts);
        Py_XDECREF(s);
    }
    Py_DECREF(d);
    if (!parts) return NULL;
    PyObject *sep = PyUnicode_FromString(", ");
    PyObject *body = sep ? PyUnicode_Join(sep, parts) : NULL;
    Py_XDECREF(sep);
    Py_DECREF(parts);
    if (!body) return NULL;
    PyObject *r = PyUnicode_FromFormat("PressSpec(%U)", body);
    Py_DECREF(body);
    return r;
}

static PyObject *PressSpec_dir(PressSpecObject *self, PyObject *unused) {
    PyObject *names = PyList_New(0);
    for (int32_t i = 0; names && i < kvc_press_param_count(); i++) {
        kvc_param_info p;
        if (kvc_press_param_info(i, &p) != KVC_OK) continue;
        PyObject *s = PyUnicode_FromString(p.name);
        if (!s || PyList_Append(names, s) < 0) Py_CLEAR(names);
        Py_XDECREF(s);
    }
    static const char *methods[] = {"get", "check", "kept", "settings", NULL};
    for (const char **m = methods; names && *m; m++) {
        PyObject *s = PyUnicode_FromString(*m);
        if (!s || PyList_Append(names, s) < 0) Py_CLEAR(names);
        Py_XDECREF(s);
    }
    return names;
}

static PyMethodDef PressSpec_methods[] = {
    {"get", (PyCFunction)PressSpec_get, METH_O, "get(name): a setting's value (a choice by its name); TypeError if unknown."},
    {"check", (PyCFunction)PressSpec_check, METH_NOARGS,
     "check(): ValueError with the C core's reason if these settings are refused (kvc_press_spec_check)."},
    {"kept", (PyCFunction)(void (*)(void))PressSpec_kept, METH_VARARGS | METH_KEYWORDS,
     "kept(n, layer=0, n_layers=1) -> tokens a KV head of n rows keeps at that layer (the C budget rule)."},
    {"settings", (PyCFunction)PressSpec_settings, METH_NOARGS,
     "settings() -> {name: value} of every setting (choices by name)."},
    {"__dir__", (PyCFunction)PressSpec_dir, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL}};

static PyType_Slot PressSpec_slots[] = {
    {Py_tp_doc, "PressSpec(scorer=None, **settings): a press's settings by name (kvc_press_spec): kvpress's defaults,\n"
                "the scorer, then the settings. spec.window or spec['window'] reads a setting, assignment sets it\n"
                "(TypeError: not a setting; ValueError: a value the C core refuses). Session.attach_press(spec)."},
    {Py_tp_new, PressSpec_new},
    {Py_tp_init, PressSpec_init},
    {Py_tp_dealloc, PressSpec_dealloc},
    {Py_tp_getattro, PressSpec_getattro},
    {Py_tp_setattro, PressSpec_setattro},
    {Py_mp_subscript, PressSpec_getitem},
    {Py_mp_ass_subscript, PressSpec_setitem},
    {Py_tp_repr, PressSpec_repr},
    {Py_tp_methods, PressSpec_methods},
    {0, NULL}};

PyType_Spec kvc_py_press_spec_spec = {"kvpress_c._core.PressSpec", sizeof(PressSpecObject), 0,
                                      Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, PressSpec_slots};
