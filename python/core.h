/* kvpress_c._core: the CPython face of the C core, one file per type (module.c, model.c, session.c,
 * judgeq.c, device.c, presses/spec.c), one for the press arguments (press_args.c), and one file per press
 * for the Session methods that serve that press alone (presses/ files, assembled into the Session type at
 * module init from kvc_py_session_method_tables). Argument checks, NumPy arrays in
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
    PyTypeObject *press_spec_type;
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
/* Assemble the Session type's method table (the session's own methods, then every array of
 * kvc_py_session_method_tables) into kvc_py_session_spec; once, before the type is made. 0 or -1. */
int kvc_py_session_methods_init(void);
int kvc_py_check_session(SessionObject *self);
PyObject *kvc_py_forward_batch(PyObject *m, PyObject *args);
/* The model's dimensions (n_layers, n_heads, n_kv_heads, head_dim, hidden, vocab). */
static inline kvc_config kvc_py_config(SessionObject *self) {
    kvc_config c;
    kvc_model_get_config(self->model->model, &c);
    return c;
}

/* The shape every binding repeats: `call` (an expression of type kvc_status) runs with the session marked
 * busy (kvc_py_check_session refuses it to other threads meanwhile) and the GIL released; then busy is
 * cleared and a failure raises the exception of its status. rc: 0, or -1 with the exception set. */
#define KVC_PY_CALL(self, rc, call)                                  \
    do {                                                             \
        kvc_status st__;                                             \
        (self)->busy = 1;                                            \
        Py_BEGIN_ALLOW_THREADS                                       \
        st__ = (call);                                               \
        Py_END_ALLOW_THREADS                                         \
        (self)->busy = 0;                                            \
        (rc) = st__ == KVC_OK ? 0 : (kvc_py_raise(st__), -1);        \
    } while (0)

/* None, or the exception of a failed status (a quick call that keeps the GIL). */
static inline PyObject *kvc_py_none(kvc_status st) {
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

/* O& converters (Py_CLEANUP_SUPPORTED: a later argument's failure releases what they took). The target is
 * a PyArrayObject * (NULL for None where a converter accepts None), owned by the caller on success. */
int kvc_py_f32_array(PyObject *obj, void *out);     /* float32, C-contiguous, any shape */
int kvc_py_f32_opt(PyObject *obj, void *out);       /* the same, or None -> NULL */
int kvc_py_f64_array(PyObject *obj, void *out);     /* float64, C-contiguous, any shape */
int kvc_py_i64_array(PyObject *obj, void *out);     /* int64, C-contiguous, any shape */
int kvc_py_i32_ids(PyObject *obj, void *out);       /* token ids: kvc_py_ids */
/* An array's shape against what the model needs: nd dimensions (the varargs, npy_intp each; -1: any), else
 * ValueError "<what> must have shape (a, b, ...), got (x, y, ...)". 0 or -1. */
int kvc_py_shape(PyArrayObject *a, const char *what, int nd, ...);
/* An array's size in values against what the model needs: "<what> has N values, this model needs M". */
int kvc_py_size(PyArrayObject *a, const char *what, int64_t want);

/* presses/ files: the Session methods of one press each (NULL-terminated PyMethodDef arrays) */
extern PyMethodDef kvc_py_kvzip_methods[], kvc_py_kvgrad_methods[], kvc_py_take_methods[], kvc_py_restorekv_methods[],
    kvc_py_kvcompose_methods[], kvc_py_hub_methods[], kvc_py_expected_attention_methods[], kvc_py_wrapper_methods[],
    kvc_py_decoding_methods[], kvc_py_diagnostics_methods[];
/* persist.c: Session.save / load, and the module's saved-cache functions */
extern PyMethodDef kvc_py_persist_methods[], kvc_py_persist_module_methods[];
/* kv_cache.c: Session.set_kv_format / kv_format, and the format's converter (a (type, group, residual) tuple) */
extern PyMethodDef kvc_py_kv_cache_methods[];
int kvc_py_kv_format(PyObject *obj, void *out);
PyObject *kvc_py_kv_format_tuple(const kvc_kv_format *f);
/* press_scope.c: Session.set_press_scope / press_scope */
extern PyMethodDef kvc_py_press_scope_methods[];

/* presses/spec.c: kvpress_c._core.PressSpec, a kvc_press_spec by name */
extern PyType_Spec kvc_py_press_spec_spec;
typedef struct {
    PyObject_HEAD
    kvc_press_spec *spec;
} PressSpecObject;
/* A new kvc_press_spec from keyword settings (None or a dict; set_one's rules); NULL with the exception. */
kvc_press_spec *kvc_py_press_spec_from(PyObject *kwargs);

/* press_args.c */
/* One setting of a spec by name, with the same rules (TypeError: unknown name; ValueError: the C message). */
int kvc_py_press_spec_set(kvc_press_spec *spec, PyObject *name, PyObject *value);
extern PyMethodDef kvc_py_press_methods[];
/* A decoding press from keyword arguments: its own settings and the base press's (by name); NULL with the
 * exception. kvc_decoding_config_free it. */
kvc_decoding_config *kvc_py_decoding_config(PyObject *kwargs);
int kvc_py_press_constants(PyObject *module);

/* presses/pyscorer.c: presses written in Python (the module's kvc_scorer_callback) */
extern PyMethodDef kvc_py_pyscorer_methods[];
/* Raise this thread's kept exception of a failed Python press when the C failure is its; 1 if raised, else 0. */
int kvc_py_raise_pending(void);
/* Whether this thread's last raised failure was a Python press's exception. */
int kvc_py_press_raised(void);
/* presses/dlview.c: the memory of a Python press's view (ViewMemory: held by its arrays; keep: the retained view's
 * handle, released with the last holder) and DLView, a read-only tensor over it exported through DLPack */
int kvc_py_dlview_init(PyObject *module);
PyObject *kvc_py_view_memory_new(void);
void kvc_py_view_memory_keep(PyObject *memory, void *handle);
PyObject *kvc_py_dlview_new(PyObject *memory, const void *data, int32_t dtype, int32_t host, int32_t ndim,
                            const int64_t *shape, const int64_t *strides);

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
