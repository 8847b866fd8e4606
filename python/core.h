/* kvpress_c._core: the CPython face of the C core, one file per type (module.c, model.c, session.c,
 * judgeq.c, device.c) and one for the press arguments (press_args.c). Argument checks, NumPy arrays in
 * and out, the GIL released around compute, C status codes turned into Python exceptions: no logic of
 * its own. Multi-phase init, heap types, module state (PEP 489/573, as CPython's _sha1module.c). */
#ifndef KVC_PY_CORE_H
#define KVC_PY_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define PY_ARRAY_UNIQUE_SYMBOL kvc_core_ARRAY_API
#ifndef KVC_PY_MODULE_C
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include "kvpress_c.h"

typedef struct {
    PyTypeObject *model_type;
    PyTypeObject *session_type;
} core_state;

extern struct PyModuleDef kvc_core_module;

static inline core_state *get_state(PyObject *module) { return (core_state *)PyModule_GetState(module); }

typedef struct {
    PyObject_HEAD
    kvc_model *model;
    PyObject *path;
} ModelObject;

typedef struct {
    PyObject_HEAD
    kvc_session *session;
    ModelObject *model; /* strong reference: the session uses the model's weights */
    int busy;           /* set while compute runs without the GIL: no concurrent use */
} SessionObject;

/* module.c */
/* Raise the Python exception matching a C status, with the C message. Returns NULL. */
PyObject *kvc_py_raise(kvc_status st);
/* Any integer sequence as a contiguous int32 1-D array (values outside int32 refused). */
PyArrayObject *kvc_py_ids(PyObject *obj);

/* model.c */
extern PyType_Spec kvc_py_model_spec;
int kvc_py_check_model(ModelObject *self);
/* A model object of this module, or NULL with TypeError. */
ModelObject *kvc_py_model_arg(PyObject *module, PyObject *obj, const char *who);
/* "cpu", "cuda" (or "cuda:0") or "emulated" -> kvc_device; -1 with ValueError. */
int kvc_py_device(const char *name);

/* session.c */
extern PyType_Spec kvc_py_session_spec;
int kvc_py_check_session(SessionObject *self);
PyObject *kvc_py_forward_batch(PyObject *m, PyObject *args);

/* press_args.c */
/* Press settings from keyword arguments (kvc_press_config field names), on top of the defaults. 0 or -1. */
int kvc_py_press_config(PyObject *kwargs, kvc_press_config *out);
extern PyMethodDef kvc_py_press_methods[];
/* A decoding press from keyword arguments: its own fields and the base press's (kvc_press_config names). */
int kvc_py_decoding_config(PyObject *kwargs, kvc_decoding_config *out);
int kvc_py_press_constants(PyObject *module);

/* judgeq.c, device.c */
extern PyMethodDef kvc_py_judgeq_methods[];
extern PyMethodDef kvc_py_device_methods[];

#define SET_ITEM(dict, key, value_expr)                              \
    do {                                                             \
        PyObject *v__ = (value_expr);                                \
        if (!v__ || PyDict_SetItemString(dict, key, v__) < 0) {      \
            Py_XDECREF(v__);                                         \
            Py_DECREF(dict);                                         \
            return NULL;                                             \
        }                                                            \
        Py_DECREF(v__);                                              \
    } while (0)

#endif
