/* kvpress_c._core: the module (state, types, the method tables of the other files), errors, token ids,
 * and the CPU backend's runtime settings (threads, external BLAS). */
#define KVC_PY_MODULE_C
#include "core.h"
#include <stdarg.h>

PyObject *kvc_py_raise(kvc_status st) {
    if (kvc_py_raise_pending()) return NULL; /* a Python press's exception, with its traceback */
    const char *msg = kvc_last_error();
    if (!msg || !*msg) msg = "kvpress_c: unknown error";
    PyObject *exc;
    switch (st) {
    case KVC_ERR_ARG:
    case KVC_ERR_FORMAT: exc = PyExc_ValueError; break;
    case KVC_ERR_IO: exc = PyExc_OSError; break;
    case KVC_ERR_NOMEM: exc = PyExc_MemoryError; break;
    case KVC_ERR_UNSUPPORTED: exc = PyExc_NotImplementedError; break;
    default: exc = PyExc_RuntimeError; break;
    }
    PyErr_SetString(exc, msg);
    return NULL;
}

/* values beyond int32 are refused here; the vocabulary range is checked in C */
PyArrayObject *kvc_py_ids(PyObject *obj) {
    PyArrayObject *arr = (PyArrayObject *)PyArray_FROMANY(obj, NPY_INT64, 1, 1, NPY_ARRAY_C_CONTIGUOUS);
    if (!arr) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "token ids must be a 1-D sequence of integers");
        return NULL;
    }
    const npy_intp n = PyArray_DIM(arr, 0);
    const int64_t *src = (const int64_t *)PyArray_DATA(arr);
    for (npy_intp i = 0; i < n; i++) {
        if (src[i] < INT32_MIN || src[i] > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "token id %lld at index %zd is outside the vocabulary", (long long)src[i], (Py_ssize_t)i);
            Py_DECREF(arr);
            return NULL;
        }
    }
    PyArrayObject *out = (PyArrayObject *)PyArray_Cast(arr, NPY_INT32);
    Py_DECREF(arr);
    return out;
}

/* ---- O& converters and shape checks (core.h) ---- */
static int array_conv(PyObject *obj, void *out, int type, int allow_none) {
    PyArrayObject **a = (PyArrayObject **)out;
    if (!obj) { /* cleanup after a later argument failed */
        Py_CLEAR(*a);
        return 1;
    }
    if (allow_none && obj == Py_None) {
        *a = NULL;
        return 1;
    }
    *a = (PyArrayObject *)PyArray_FROMANY(obj, type, 0, 0, NPY_ARRAY_C_CONTIGUOUS);
    return *a ? Py_CLEANUP_SUPPORTED : 0;
}
int kvc_py_f32_array(PyObject *obj, void *out) { return array_conv(obj, out, NPY_FLOAT32, 0); }
int kvc_py_f32_opt(PyObject *obj, void *out) { return array_conv(obj, out, NPY_FLOAT32, 1); }
int kvc_py_f64_array(PyObject *obj, void *out) { return array_conv(obj, out, NPY_FLOAT64, 0); }
int kvc_py_i64_array(PyObject *obj, void *out) { return array_conv(obj, out, NPY_INT64, 0); }
int kvc_py_i32_ids(PyObject *obj, void *out) {
    PyArrayObject **a = (PyArrayObject **)out;
    if (!obj) {
        Py_CLEAR(*a);
        return 1;
    }
    *a = kvc_py_ids(obj);
    return *a ? Py_CLEANUP_SUPPORTED : 0;
}

static int shape_str(char *buf, size_t cap, int nd, const npy_intp *dims) {
    size_t k = 0;
    k += (size_t)snprintf(buf + k, cap - k, "(");
    for (int i = 0; i < nd && k < cap; i++)
        k += dims[i] < 0 ? (size_t)snprintf(buf + k, cap - k, "%sn", i ? ", " : "")
                         : (size_t)snprintf(buf + k, cap - k, "%s%lld", i ? ", " : "", (long long)dims[i]);
    if (k < cap) snprintf(buf + k, cap - k, ")");
    return 0;
}

int kvc_py_shape(PyArrayObject *a, const char *what, int nd, ...) {
    npy_intp want[NPY_MAXDIMS];
    va_list ap;
    va_start(ap, nd);
    for (int i = 0; i < nd && i < NPY_MAXDIMS; i++) want[i] = va_arg(ap, npy_intp);
    va_end(ap);
    int ok = PyArray_NDIM(a) == nd;
    for (int i = 0; ok && i < nd; i++) ok = want[i] < 0 || PyArray_DIM(a, i) == want[i];
    if (ok) return 0;
    char w[160], g[160];
    shape_str(w, sizeof w, nd, want);
    shape_str(g, sizeof g, PyArray_NDIM(a), PyArray_DIMS(a));
    PyErr_Format(PyExc_ValueError, "%s must have shape %s, got %s", what, w, g);
    return -1;
}

int kvc_py_size(PyArrayObject *a, const char *what, int64_t want) {
    if ((int64_t)PyArray_SIZE(a) == want) return 0;
    PyErr_Format(PyExc_ValueError, "%s has %lld values, this model needs %lld", what, (long long)PyArray_SIZE(a), (long long)want);
    return -1;
}

static PyObject *mod_set_blas(PyObject *m, PyObject *args) {
    PyObject *path_obj = Py_None;
    const char *symbol = NULL;
    if (!PyArg_ParseTuple(args, "|Oz", &path_obj, &symbol)) return NULL;
    kvc_status st;
    if (path_obj == Py_None) {
        st = kvc_set_blas(NULL, NULL);
    } else {
        PyObject *b = NULL;
        if (!PyUnicode_FSConverter(path_obj, &b)) return NULL;
        st = kvc_set_blas(PyBytes_AS_STRING(b), symbol ? symbol : "scipy_cblas_sgemm");
        Py_DECREF(b);
    }
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *mod_blas_name(PyObject *m, PyObject *unused) { return PyUnicode_FromString(kvc_blas_name()); }

static PyObject *mod_set_num_threads(PyObject *m, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    kvc_set_num_threads((int)n);
    Py_RETURN_NONE;
}

static PyObject *mod_get_num_threads(PyObject *m, PyObject *unused) { return PyLong_FromLong(kvc_get_num_threads()); }

static PyMethodDef module_methods[] = {
    {"forward_batch", kvc_py_forward_batch, METH_VARARGS,
     "forward_batch(sessions, ids): one token per session (no press attached), float32 logits [B, vocab];\n"
     "the weight GEMMs run once for all sessions."},
    {"set_blas", mod_set_blas, METH_VARARGS, "set_blas(path=None, symbol='scipy_cblas_sgemm'): external CBLAS sgemm or the built-in GEMM."},
    {"blas_name", mod_blas_name, METH_NOARGS, "Name of the GEMM in use."},
    {"set_num_threads", mod_set_num_threads, METH_O, "Threads of the CPU backend (<= 0: all cores)."},
    {"get_num_threads", mod_get_num_threads, METH_NOARGS, "Threads of the CPU backend."},
    {NULL, NULL, 0, NULL}};

static int add_methods(PyObject *m, PyMethodDef *defs) {
    return PyModule_AddFunctions(m, defs);
}

static int module_exec(PyObject *m) {
    if (_import_array() < 0) return -1;
    core_state *state = get_state(m);
    state->model_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &kvc_py_model_spec, NULL);
    if (!state->model_type || PyModule_AddType(m, state->model_type) < 0) return -1;
    if (kvc_py_session_methods_init() < 0) return -1;
    state->session_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &kvc_py_session_spec, NULL);
    if (!state->session_type || PyModule_AddType(m, state->session_type) < 0) return -1;
    state->press_spec_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &kvc_py_press_spec_spec, NULL);
    if (!state->press_spec_type || PyModule_AddType(m, state->press_spec_type) < 0) return -1;
    if (add_methods(m, kvc_py_press_methods) < 0 || add_methods(m, kvc_py_judgeq_methods) < 0 ||
        add_methods(m, kvc_py_device_methods) < 0 || add_methods(m, kvc_py_pyscorer_methods) < 0 ||
        add_methods(m, kvc_py_persist_module_methods) < 0)
        return -1;
    if (kvc_py_press_constants(m) < 0) return -1;
    if (kvc_py_dlview_init(m) < 0) return -1;
    if (PyModule_AddStringConstant(m, "__version__", kvc_version()) < 0) return -1;
    return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
    core_state *state = get_state(m);
    Py_VISIT(state->model_type);
    Py_VISIT(state->session_type);
    Py_VISIT(state->press_spec_type);
    return 0;
}

static int module_clear(PyObject *m) {
    core_state *state = get_state(m);
    Py_CLEAR(state->model_type);
    Py_CLEAR(state->session_type);
    Py_CLEAR(state->press_spec_type);
    return 0;
}

static void module_free(void *m) { module_clear((PyObject *)m); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL}};

struct PyModuleDef kvc_core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvpress_c._core",
    .m_doc = "C core of kvpress_c: models on devices, sessions with ragged KV caches, presses.",
    .m_size = sizeof(core_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&kvc_core_module); }
