/* Press settings from Python: keywords set by name through the C table (kvc_press_spec_set_*, csrc/press/
 * params.c), so no list of fields or format string is repeated here; the C validation and budget arithmetic
 * the dataclasses call instead of repeating them; the names of the choices read from the C table. */
#include "core.h"

/* The setters of one config kind, by name. */
typedef struct {
    void *obj;
    kvc_status (*set_i64)(void *obj, const char *name, int64_t v);
    kvc_status (*set_u64)(void *obj, const char *name, uint64_t v);
    kvc_status (*set_f64)(void *obj, const char *name, double v);
    kvc_status (*set_str)(void *obj, const char *name, const char *v);
    int32_t (*known)(const char *name);
    const char *what;
} setters;

/* One keyword: a str sets a choice by name, a bool or an int an integer (a large one an unsigned), a float a
 * number; None only clears a flag. The C setter says what is wrong with a value (ValueError). */
static int set_one(const setters *t, PyObject *key, PyObject *value) {
    const char *name = PyUnicode_Check(key) ? PyUnicode_AsUTF8(key) : NULL;
    if (!name) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "press settings are keywords (str)");
        return -1;
    }
    if (!t->known(name)) {
        PyErr_Format(PyExc_TypeError, "'%s' is not a %s setting (kvpress_c.press_params() lists them)", name, t->what);
        return -1;
    }
    kvc_status st;
    if (PyUnicode_Check(value)) {
        const char *v = PyUnicode_AsUTF8(value);
        if (!v) return -1;
        st = t->set_str(t->obj, name, v);
    } else if (value == Py_None) {
        st = t->set_i64(t->obj, name, 0);
    } else if (PyBool_Check(value)) {
        st = t->set_i64(t->obj, name, value == Py_True);
    } else if (PyFloat_Check(value)) {
        st = t->set_f64(t->obj, name, PyFloat_AS_DOUBLE(value));
    } else {
        PyObject *i = PyNumber_Index(value); /* ints and NumPy integers */
        if (!i) {
            PyErr_Clear();
            const double d = PyFloat_AsDouble(value);
            if (d == -1.0 && PyErr_Occurred()) {
                PyErr_Format(PyExc_TypeError, "%s must be a number or a name, got %R", name, value);
                return -1;
            }
            st = t->set_f64(t->obj, name, d);
        } else {
            int overflow = 0;
            const long long v = PyLong_AsLongLongAndOverflow(i, &overflow);
            if (overflow > 0) {
                const unsigned long long u = PyLong_AsUnsignedLongLong(i);
                Py_DECREF(i);
                if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
                st = t->set_u64(t->obj, name, u);
            } else {
                Py_DECREF(i);
                if (overflow < 0 || (v == -1 && PyErr_Occurred())) {
                    PyErr_Clear();
                    PyErr_Format(PyExc_ValueError, "%s: %R is out of range", name, value);
                    return -1;
                }
                st = t->set_i64(t->obj, name, v);
            }
        }
    }
    return st == KVC_OK ? 0 : (kvc_py_raise(st), -1);
}

static int set_all(const setters *t, PyObject *kwargs) {
    if (!kwargs) return 0;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwargs, &pos, &key, &value))
        if (set_one(t, key, value) < 0) return -1;
    return 0;
}

#define SETTERS(kind, type)                                                                                        \
    static kvc_status kind##_i64(void *o, const char *n, int64_t v) { return kvc_##kind##_set_i64((type *)o, n, v); } \
    static kvc_status kind##_u64(void *o, const char *n, uint64_t v) { return kvc_##kind##_set_u64((type *)o, n, v); } \
    static kvc_status kind##_f64(void *o, const char *n, double v) { return kvc_##kind##_set_f64((type *)o, n, v); } \
    static kvc_status kind##_str(void *o, const char *n, const char *v) { return kvc_##kind##_set_str((type *)o, n, v); }
SETTERS(decoding_config, kvc_decoding_config)
SETTERS(press_spec, kvc_press_spec)
static int32_t press_known(const char *name) { return kvc_press_param_index(name) >= 0; }

/* ---- a kvc_press_spec (PressSpec, Session.set_press, Session.add_press): the same rules ---- */
int kvc_py_press_spec_set(kvc_press_spec *spec, PyObject *name, PyObject *value) {
    const setters t = {spec, press_spec_i64, press_spec_u64, press_spec_f64, press_spec_str, press_known, "press"};
    return set_one(&t, name, value);
}

kvc_press_spec *kvc_py_press_spec_from(PyObject *kwargs) {
    kvc_press_spec *spec = NULL;
    kvc_status st = kvc_press_spec_new(NULL, &spec);
    if (st != KVC_OK) return (kvc_py_raise(st), NULL);
    const setters t = {spec, press_spec_i64, press_spec_u64, press_spec_f64, press_spec_str, press_known, "press"};
    if (set_all(&t, kwargs) < 0) {
        kvc_press_spec_free(spec);
        return NULL;
    }
    return spec;
}

/* ---- decoding presses: the decoding settings, the rest the base press's ---- */
kvc_decoding_config *kvc_py_decoding_config(PyObject *kwargs) {
    kvc_decoding_config *c = NULL;
    const kvc_status st = kvc_decoding_config_new(&c);
    if (st != KVC_OK) return (kvc_py_raise(st), NULL);
    const setters t = {c, decoding_config_i64, decoding_config_u64, decoding_config_f64, decoding_config_str,
                       kvc_decoding_param_known, "decoding press"};
    if (set_all(&t, kwargs) < 0) {
        kvc_decoding_config_free(c);
        return NULL;
    }
    return c;
}

/* decoding_config_check(**settings): ValueError with the C message when kvc_decoding_config_check refuses them. */
static PyObject *mod_decoding_config_check(PyObject *m, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "decoding_config_check takes keyword arguments only");
        return NULL;
    }
    kvc_decoding_config *c = kvc_py_decoding_config(kwds);
    if (!c) return NULL;
    const kvc_status st = kvc_decoding_config_check(c);
    kvc_decoding_config_free(c);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

/* press_config_check(**settings): ValueError with the C message when kvc_press_spec_check refuses them. */
static PyObject *mod_press_config_check(PyObject *m, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "press_config_check takes keyword arguments only");
        return NULL;
    }
    kvc_press_spec *spec = kvc_py_press_spec_from(kwds);
    if (!spec) return NULL;
    const kvc_status st = kvc_press_spec_check(spec);
    kvc_press_spec_free(spec);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

/* press_kept(n, layer=0, n_layers=1, **settings) -> tokens a head of n rows keeps */
static PyObject *mod_press_kept(PyObject *m, PyObject *args, PyObject *kwds) {
    long long n;
    int layer = 0, n_layers = 1;
    if (!PyArg_ParseTuple(args, "L|ii", &n, &layer, &n_layers)) return NULL;
    kvc_press_spec *spec = kvc_py_press_spec_from(kwds);
    if (!spec) return NULL;
    int64_t out = 0;
    const kvc_status st = kvc_press_spec_kept(spec, layer, n_layers, n, &out);
    kvc_press_spec_free(spec);
    if (st != KVC_OK) return kvc_py_raise(st);
    return PyLong_FromLongLong(out);
}

/* tada_allocate(weights, total, lo, hi) -> int64 [L] */
static PyObject *mod_tada_allocate(PyObject *m, PyObject *args) {
    PyObject *w_obj;
    long long total, lo, hi;
    if (!PyArg_ParseTuple(args, "OLLL", &w_obj, &total, &lo, &hi)) return NULL;
    PyArrayObject *w = (PyArrayObject *)PyArray_FROMANY(w_obj, NPY_FLOAT64, 1, 1, NPY_ARRAY_C_CONTIGUOUS);
    if (!w) return NULL;
    npy_intp dims[1] = {PyArray_DIM(w, 0)};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_INT64);
    if (!out) {
        Py_DECREF(w);
        return NULL;
    }
    kvc_status st = kvc_tada_allocate((const double *)PyArray_DATA(w), (int32_t)dims[0], total, lo, hi,
                                      (int64_t *)PyArray_DATA(out));
    Py_DECREF(w);
    if (st != KVC_OK) {
        Py_DECREF(out);
        return kvc_py_raise(st);
    }
    return (PyObject *)out;
}

PyMethodDef kvc_py_press_methods[] = {
    {"press_config_check", (PyCFunction)(void (*)(void))mod_press_config_check, METH_VARARGS | METH_KEYWORDS,
     "press_config_check(**settings): ValueError with the reason if the C core refuses these press settings."},
    {"decoding_config_check", (PyCFunction)(void (*)(void))mod_decoding_config_check, METH_VARARGS | METH_KEYWORDS,
     "decoding_config_check(**settings): the C check of a decoding press (its fields and the base press's)."},
    {"press_kept", (PyCFunction)(void (*)(void))mod_press_kept, METH_VARARGS | METH_KEYWORDS,
     "press_kept(n, layer=0, n_layers=1, **settings) -> tokens a KV head of n rows keeps (the C budget rule)."},
    {"tada_allocate", mod_tada_allocate, METH_VARARGS,
     "tada_allocate(weights[L], total, lo, hi) -> int64 [L]: TADA's layer capacities, proportional to the weights,\n"
     "each in [lo, hi], summing to total."},
    {NULL, NULL, 0, NULL}};

/* SCORERS, ALLOCATIONS, SAFEGUARDS: name -> code, the choices of those settings in the C table; PRESS_PARAMS:
 * every setting's name -> (type, default, lo, hi, doc, choices) */
static int add_choices(PyObject *m, const char *attr, const kvc_param_info *p) {
    PyObject *d = PyDict_New();
    if (!d) return -1;
    for (int32_t i = 0; i < p->n_choices; i++) {
        PyObject *v = PyLong_FromLong(i);
        if (!v || PyDict_SetItemString(d, p->choices[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return -1;
        }
        Py_DECREF(v);
    }
    const int r = PyModule_AddObjectRef(m, attr, d);
    Py_DECREF(d);
    return r;
}

/* PRESS_ARRAYS: every press array's name -> (press, type, shape, doc) (kvc_press_array_info) */
static int press_arrays(PyObject *m) {
    static const char *const types[] = {"float32", "float64", "int64"};
    PyObject *arrays = PyDict_New();
    if (!arrays) return -1;
    int r = 0;
    for (int32_t i = 0; i < kvc_press_array_count() && r == 0; i++) {
        kvc_press_array_desc d;
        if (kvc_press_array_info(i, &d) != KVC_OK) {
            kvc_py_raise(KVC_ERR_ARG);
            r = -1;
            break;
        }
        PyObject *row = Py_BuildValue("{s:s,s:s,s:s,s:s}", "press", d.press, "type", types[d.type], "shape", d.shape,
                                      "doc", d.doc);
        if (!row || PyDict_SetItemString(arrays, d.name, row) < 0) r = -1;
        Py_XDECREF(row);
    }
    if (r == 0) r = PyModule_AddObjectRef(m, "PRESS_ARRAYS", arrays);
    Py_DECREF(arrays);
    return r;
}

int kvc_py_press_constants(PyObject *m) {
    PyObject *params = PyDict_New();
    if (!params) return -1;
    int r = 0;
    for (int32_t i = 0; i < kvc_press_param_count() && r == 0; i++) {
        kvc_param_info p;
        if (kvc_press_param_info(i, &p) != KVC_OK) {
            r = -1;
            kvc_py_raise(KVC_ERR_ARG);
            break;
        }
        PyObject *choices = PyTuple_New(p.n_choices);
        for (int32_t j = 0; choices && j < p.n_choices; j++) PyTuple_SET_ITEM(choices, j, PyUnicode_FromString(p.choices[j]));
        PyObject *row = choices ? Py_BuildValue("{s:s,s:d,s:d,s:d,s:s,s:N}", "type", p.type, "default", p.default_value, "lo",
                                               p.lo, "hi", p.hi, "doc", p.doc, "choices", choices)
                                : NULL;
        if (!row || PyDict_SetItemString(params, p.name, row) < 0) r = -1;
        Py_XDECREF(row);
        if (r == 0 && p.n_choices) {
            const char *attr = !strcmp(p.name, "scorer") ? "SCORERS" : !strcmp(p.name, "allocation") ? "ALLOCATIONS"
                             : !strcmp(p.name, "safeguard") ? "SAFEGUARDS" : NULL;
            if (attr) r = add_choices(m, attr, &p);
        }
    }
    if (r == 0) r = PyModule_AddObjectRef(m, "PRESS_PARAMS", params);
    Py_DECREF(params);
    return r == 0 ? press_arrays(m) : r;
}
