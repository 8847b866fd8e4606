/*
 * kvpress_c._core: the CPython face of the C core. Argument checks, NumPy arrays in and out, the GIL
 * released around compute, C status codes turned into Python exceptions. No logic of its own.
 *
 * Multi-phase init, heap types, module state (PEP 489/573 style, as CPython's _sha1module.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <numpy/arrayobject.h>

#include "kvpress_c.h"

/* ---------------------------------------------------------------------------------------------- */
/* module state and errors                                                                         */

typedef struct {
    PyTypeObject *model_type;
    PyTypeObject *session_type;
} core_state;

static struct PyModuleDef core_module;

static inline core_state *get_state(PyObject *module) { return (core_state *)PyModule_GetState(module); }

/* Raise the Python exception matching a C status, with the C message. Returns NULL. */
static PyObject *raise_status(kvc_status st) {
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

/* ---------------------------------------------------------------------------------------------- */
/* Model                                                                                           */

typedef struct {
    PyObject_HEAD
    kvc_model *model;
    PyObject *path;
} ModelObject;

static int Model_init(ModelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path", "device", NULL};
    PyObject *path_obj = NULL;
    const char *device = "cpu";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|s", kwlist, PyUnicode_FSConverter, &path_obj, &device)) return -1;
    int32_t dev;
    if (strcmp(device, "cpu") == 0) {
        dev = KVC_DEVICE_CPU;
    } else if (strcmp(device, "cuda") == 0 || strcmp(device, "cuda:0") == 0) {
        dev = KVC_DEVICE_CUDA;
    } else {
        PyErr_Format(PyExc_ValueError, "device must be 'cpu' or 'cuda', got '%s'", device);
        Py_DECREF(path_obj);
        return -1;
    }
    if (self->model) {
        PyErr_SetString(PyExc_RuntimeError, "Model is already initialised");
        Py_DECREF(path_obj);
        return -1;
    }
    const char *path = PyBytes_AS_STRING(path_obj);
    kvc_model *m = NULL;
    kvc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_model_load_device(path, dev, &m);
    Py_END_ALLOW_THREADS
    if (st != KVC_OK) {
        Py_DECREF(path_obj);
        if (dev == KVC_DEVICE_CUDA && st == KVC_ERR_DEVICE)
            PyErr_Format(PyExc_RuntimeError, "%s; use device='cpu'", kvc_last_error());
        else
            raise_status(st);
        return -1;
    }
    self->model = m;
    self->path = PyUnicode_DecodeFSDefault(path);
    Py_DECREF(path_obj);
    return self->path ? 0 : -1;
}

static void Model_dealloc(ModelObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    kvc_model_free(self->model);
    Py_CLEAR(self->path);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int Model_traverse(ModelObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int check_model(ModelObject *self) {
    if (!self->model) {
        PyErr_SetString(PyExc_RuntimeError, "Model is not loaded");
        return -1;
    }
    return 0;
}

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

static PyObject *Model_get_config(ModelObject *self, void *closure) {
    if (check_model(self) < 0) return NULL;
    kvc_config c;
    kvc_model_get_config(self->model, &c);
    static const char *arch_names[] = {"llama", "mistral", "qwen2"};
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    SET_ITEM(d, "arch", PyUnicode_FromString(c.arch >= 0 && c.arch <= 2 ? arch_names[c.arch] : "?"));
    SET_ITEM(d, "n_layers", PyLong_FromLong(c.n_layers));
    SET_ITEM(d, "hidden", PyLong_FromLong(c.hidden));
    SET_ITEM(d, "n_heads", PyLong_FromLong(c.n_heads));
    SET_ITEM(d, "n_kv_heads", PyLong_FromLong(c.n_kv_heads));
    SET_ITEM(d, "head_dim", PyLong_FromLong(c.head_dim));
    SET_ITEM(d, "ffn", PyLong_FromLong(c.ffn));
    SET_ITEM(d, "vocab", PyLong_FromLong(c.vocab));
    SET_ITEM(d, "max_context", PyLong_FromLong(c.max_context));
    SET_ITEM(d, "rope_pairing", PyUnicode_FromString(c.rope_pairing == KVC_ROPE_ADJACENT ? "adjacent" : "half"));
    SET_ITEM(d, "tied_embeddings", PyBool_FromLong(c.tied_embeddings));
    SET_ITEM(d, "qkv_bias", PyBool_FromLong(c.qkv_bias));
    SET_ITEM(d, "rms_eps", PyFloat_FromDouble(c.rms_eps));
    SET_ITEM(d, "rope_theta", PyFloat_FromDouble(c.rope_theta));
    SET_ITEM(d, "rope_scaling_factor", PyFloat_FromDouble(c.rope_scaling_factor));
    SET_ITEM(d, "bos_id", PyLong_FromLong(c.bos_id));
    SET_ITEM(d, "eos_id", PyLong_FromLong(c.eos_id));
    SET_ITEM(d, "format", PyUnicode_FromString(kvc_model_format(self->model)));
    SET_ITEM(d, "weight_bytes", PyLong_FromSize_t(kvc_model_weight_bytes(self->model)));
    return d;
}

/* One GGUF metadata value as a Python object (scalars unwrapped, arrays as lists). */
static PyObject *meta_value(kvc_model *m, int64_t i, int32_t type, int32_t is_array, uint64_t n) {
    PyObject *list = NULL;
    if (is_array) {
        if (n > (uint64_t)PY_SSIZE_T_MAX) return PyErr_NoMemory();
        list = PyList_New((Py_ssize_t)n);
        if (!list) return NULL;
    }
    for (uint64_t j = 0; j < (is_array ? n : 1); j++) {
        PyObject *item;
        kvc_status st;
        if (type == 8) {
            const char *s;
            uint64_t len;
            st = kvc_model_meta_string(m, i, j, &s, &len);
            if (st != KVC_OK) goto fail_status;
            item = PyUnicode_DecodeUTF8(s, (Py_ssize_t)len, "replace");
        } else {
            double v;
            st = kvc_model_meta_number(m, i, j, &v);
            if (st != KVC_OK) goto fail_status;
            if (type == 7) item = PyBool_FromLong(v != 0);
            else if (type == 6 || type == 12) item = PyFloat_FromDouble(v);
            else item = PyLong_FromDouble(v);
        }
        if (!item) {
            Py_XDECREF(list);
            return NULL;
        }
        if (!is_array) return item;
        PyList_SET_ITEM(list, (Py_ssize_t)j, item);
        continue;
    fail_status:
        Py_XDECREF(list);
        return raise_status(st);
    }
    return list;
}

static PyObject *Model_metadata(ModelObject *self, PyObject *unused) {
    if (check_model(self) < 0) return NULL;
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    const int64_t count = kvc_model_meta_count(self->model);
    for (int64_t i = 0; i < count; i++) {
        const char *key;
        int32_t type, is_array;
        uint64_t n;
        kvc_status st = kvc_model_meta_info(self->model, i, &key, &type, &is_array, &n);
        if (st != KVC_OK) {
            Py_DECREF(d);
            return raise_status(st);
        }
        PyObject *v = meta_value(self->model, i, type, is_array, n);
        if (!v || PyDict_SetItemString(d, key, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

static PyObject *Model_get_device(ModelObject *self, void *closure) {
    if (check_model(self) < 0) return NULL;
    return PyUnicode_FromString(kvc_model_device(self->model) == KVC_DEVICE_CUDA ? "cuda" : "cpu");
}

static PyObject *Model_get_path(ModelObject *self, void *closure) {
    if (!self->path) Py_RETURN_NONE;
    return Py_NewRef(self->path);
}

static PyMethodDef Model_methods[] = {
    {"metadata", (PyCFunction)Model_metadata, METH_NOARGS, "GGUF metadata as a dict (empty for safetensors)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Model_getset[] = {
    {"config", (getter)Model_get_config, NULL, "Model configuration (dict).", NULL},
    {"path", (getter)Model_get_path, NULL, "Path the model was loaded from.", NULL},
    {"device", (getter)Model_get_device, NULL, "'cpu' or 'cuda': where the model's sessions run.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot Model_slots[] = {
    {Py_tp_doc, "Model(path): a GGUF file or Hugging Face folder loaded into the C core."},
    {Py_tp_init, Model_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, Model_dealloc},
    {Py_tp_traverse, Model_traverse},
    {Py_tp_methods, Model_methods},
    {Py_tp_getset, Model_getset},
    {0, NULL}};

static PyType_Spec Model_spec = {"kvpress_c._core.Model", sizeof(ModelObject), 0,
                                 Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
                                 Model_slots};

/* ---------------------------------------------------------------------------------------------- */
/* Session                                                                                         */

typedef struct {
    PyObject_HEAD
    kvc_session *session;
    ModelObject *model; /* strong reference: the session uses the model's weights */
    int busy;           /* set while compute runs without the GIL: no concurrent use */
} SessionObject;

static int Session_init(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"model", "capacity", NULL};
    PyObject *model_obj;
    long long capacity = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|L", kwlist, &model_obj, &capacity)) return -1;
    PyObject *module = PyType_GetModuleByDef(Py_TYPE(self), &core_module);
    if (!module) return -1;
    if (!PyObject_TypeCheck(model_obj, get_state(module)->model_type)) {
        PyErr_Format(PyExc_TypeError, "Session(model): model must be a kvpress_c._core.Model, not %.100s",
                     Py_TYPE(model_obj)->tp_name);
        return -1;
    }
    ModelObject *mo = (ModelObject *)model_obj;
    if (check_model(mo) < 0) return -1;
    if (capacity < 0) {
        PyErr_SetString(PyExc_ValueError, "capacity must be >= 0");
        return -1;
    }
    if (self->session) {
        PyErr_SetString(PyExc_RuntimeError, "Session is already initialised");
        return -1;
    }
    kvc_status st = kvc_session_new(mo->model, capacity, &self->session);
    if (st != KVC_OK) {
        raise_status(st);
        return -1;
    }
    Py_INCREF(mo);
    self->model = mo;
    return 0;
}

static void Session_dealloc(SessionObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    kvc_session_free(self->session);
    Py_CLEAR(self->model);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int Session_traverse(SessionObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->model);
    return 0;
}

static int Session_clear(SessionObject *self) {
    Py_CLEAR(self->model);
    return 0;
}

static int check_session(SessionObject *self) {
    if (!self->session) {
        PyErr_SetString(PyExc_RuntimeError, "Session is not initialised");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Session is in use by another thread");
        return -1;
    }
    return 0;
}

/* Convert any integer sequence to a contiguous int32 1-D array; values are range-checked in C. */
static PyArrayObject *as_ids(PyObject *obj) {
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

static PyObject *Session_forward(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "logits", "embeddings", NULL};
    PyObject *ids_obj, *mode_obj = NULL, *emb_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OO", kwlist, &ids_obj, &mode_obj, &emb_obj)) return NULL;
    if (check_session(self) < 0) return NULL;
    kvc_config cfg;
    kvc_model_get_config(self->model->model, &cfg);
    PyArrayObject *ids = NULL, *emb = NULL, *logits = NULL;
    npy_intp n_ids = 0, n_emb = 0;
    if (ids_obj != Py_None && !(PySequence_Check(ids_obj) && PySequence_Size(ids_obj) == 0)) {
        if (!(ids = as_ids(ids_obj))) return NULL;
        n_ids = PyArray_DIM(ids, 0);
    }
    if (emb_obj != Py_None) {
        emb = (PyArrayObject *)PyArray_FROMANY(emb_obj, NPY_FLOAT32, 2, 2, NPY_ARRAY_C_CONTIGUOUS);
        if (!emb) goto fail;
        if (PyArray_DIM(emb, 1) != cfg.hidden) {
            PyErr_Format(PyExc_ValueError, "embeddings must have shape (n, %d), got (%zd, %zd)", cfg.hidden,
                         (Py_ssize_t)PyArray_DIM(emb, 0), (Py_ssize_t)PyArray_DIM(emb, 1));
            goto fail;
        }
        n_emb = PyArray_DIM(emb, 0);
    }
    const npy_intp n = n_ids + n_emb;
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "forward() needs at least one token");
        goto fail;
    }
    int64_t row;
    if (!mode_obj || (PyUnicode_Check(mode_obj) && PyUnicode_CompareWithASCIIString(mode_obj, "last") == 0)) row = n - 1;
    else if (PyUnicode_Check(mode_obj) && PyUnicode_CompareWithASCIIString(mode_obj, "all") == 0) row = KVC_ROW_ALL;
    else if (PyUnicode_Check(mode_obj) && PyUnicode_CompareWithASCIIString(mode_obj, "none") == 0) row = KVC_ROW_NONE;
    else if (PyLong_Check(mode_obj)) {
        row = PyLong_AsLongLong(mode_obj);
        if (row == -1 && PyErr_Occurred()) goto fail;
        if (row < 0) row += n;
        if (row < 0 || row >= n) {
            PyErr_Format(PyExc_IndexError, "logits row out of range for %zd tokens", (Py_ssize_t)n);
            goto fail;
        }
    } else {
        PyErr_SetString(PyExc_ValueError, "logits must be 'none', 'last', 'all' or a row index");
        goto fail;
    }
    if (row == KVC_ROW_ALL) {
        npy_intp dims[2] = {n, cfg.vocab};
        logits = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    } else if (row != KVC_ROW_NONE) {
        npy_intp dims[1] = {cfg.vocab};
        logits = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_FLOAT32);
    }
    if (row != KVC_ROW_NONE && !logits) goto fail;
    kvc_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_forward_ex(self->session, ids ? (const int32_t *)PyArray_DATA(ids) : NULL, n_ids,
                        emb ? (const float *)PyArray_DATA(emb) : NULL, n_emb, row,
                        logits ? (float *)PyArray_DATA(logits) : NULL);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    Py_XDECREF(ids);
    Py_XDECREF(emb);
    if (st != KVC_OK) {
        Py_XDECREF(logits);
        return raise_status(st);
    }
    if (!logits) Py_RETURN_NONE;
    return (PyObject *)logits;
fail:
    Py_XDECREF(ids);
    Py_XDECREF(emb);
    Py_XDECREF(logits);
    return NULL;
}

/* forward_shared(ids, followers, logits='last'): one prefill whose K/V every follower session also
 * receives, each compressing with its own attached press (kvc_forward_shared). */
static PyObject *Session_forward_shared(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "followers", "logits", NULL};
    PyObject *ids_obj, *fol_obj, *mode_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O", kwlist, &ids_obj, &fol_obj, &mode_obj)) return NULL;
    if (check_session(self) < 0) return NULL;
    int want_logits = 1;
    if (mode_obj && PyUnicode_Check(mode_obj) && PyUnicode_CompareWithASCIIString(mode_obj, "none") == 0) want_logits = 0;
    else if (mode_obj && !(PyUnicode_Check(mode_obj) && PyUnicode_CompareWithASCIIString(mode_obj, "last") == 0)) {
        PyErr_SetString(PyExc_ValueError, "forward_shared: logits must be 'last' or 'none'");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(fol_obj, "followers must be a sequence of Session objects");
    if (!seq) return NULL;
    const Py_ssize_t nf = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    kvc_session **fs = PyMem_Calloc(nf ? (size_t)nf : 1, sizeof *fs);
    PyArrayObject *ids = NULL, *logits = NULL;
    Py_ssize_t marked = 0;
    if (!fs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nf; i++) {
        SessionObject *f = (SessionObject *)items[i];
        if (Py_TYPE(items[i]) != Py_TYPE(self)) {
            PyErr_Format(PyExc_TypeError, "follower %zd is not a Session", i);
            goto done;
        }
        if (check_session(f) < 0) goto done;
        if (f->model != self->model) {
            PyErr_Format(PyExc_ValueError, "follower %zd belongs to another model", i);
            goto done;
        }
        fs[i] = f->session;
    }
    if (!(ids = as_ids(ids_obj))) goto done;
    const npy_intp n = PyArray_DIM(ids, 0);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "forward_shared() needs at least one token");
        goto done;
    }
    if (want_logits) {
        kvc_config cfg;
        kvc_model_get_config(self->model->model, &cfg);
        npy_intp dims[1] = {cfg.vocab};
        if (!(logits = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_FLOAT32))) goto done;
    }
    kvc_status st;
    self->busy = 1;
    for (; marked < nf; marked++) ((SessionObject *)items[marked])->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_forward_shared(self->session, fs, (int32_t)nf, (const int32_t *)PyArray_DATA(ids), n,
                            want_logits ? n - 1 : KVC_ROW_NONE, logits ? (float *)PyArray_DATA(logits) : NULL);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    for (Py_ssize_t i = 0; i < marked; i++) ((SessionObject *)items[i])->busy = 0;
    if (st != KVC_OK) {
        Py_CLEAR(logits);
        raise_status(st);
    }
done:
    PyMem_Free(fs);
    Py_XDECREF(ids);
    Py_DECREF(seq);
    if (PyErr_Occurred()) {
        Py_XDECREF(logits);
        return NULL;
    }
    if (!logits) Py_RETURN_NONE;
    return (PyObject *)logits;
}

static PyObject *Session_set_position(SessionObject *self, PyObject *arg) {
    if (check_session(self) < 0) return NULL;
    long long pos = PyLong_AsLongLong(arg);
    if (pos == -1 && PyErr_Occurred()) return NULL;
    kvc_status st = kvc_session_set_position(self->session, pos);
    if (st != KVC_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Session_reset(SessionObject *self, PyObject *unused) {
    if (check_session(self) < 0) return NULL;
    kvc_session_reset(self->session);
    Py_RETURN_NONE;
}

static PyObject *Session_cache_lengths(SessionObject *self, PyObject *unused) {
    if (check_session(self) < 0) return NULL;
    kvc_config cfg;
    kvc_model_get_config(self->model->model, &cfg);
    npy_intp dims[2] = {cfg.n_layers, cfg.n_kv_heads};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_INT64);
    if (!out) return NULL;
    int64_t *p = (int64_t *)PyArray_DATA(out);
    for (int l = 0; l < cfg.n_layers; l++)
        for (int h = 0; h < cfg.n_kv_heads; h++) p[l * cfg.n_kv_heads + h] = kvc_session_cache_len(self->session, l, h);
    return (PyObject *)out;
}


static PyObject *Session_set_press(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"scorer", "allocation", "compression_ratio", "budget", "window", "kernel",
                             "pool_max", "gqa_max", "pool_then_reduce", "n_sink", "seed", "alpha_safeguard",
                             "safeguard", "pyramid_beta", "record_scores", "chunk_length", "reuse_layers", "edie_alpha", "drop_window", NULL};
    if (check_session(self) < 0) return NULL;
    if (PyTuple_GET_SIZE(args) == 1 && PyTuple_GET_ITEM(args, 0) == Py_None && (!kwds || PyDict_GET_SIZE(kwds) == 0)) {
        kvc_session_set_press(self->session, NULL);
        Py_RETURN_NONE;
    }
    kvc_press_config c;
    kvc_press_config_defaults(&c);
    long long budget = 0;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$iidLiiiiiiKfiipiifp", kwlist, &c.scorer, &c.allocation,
                                     &c.compression_ratio, &budget, &c.window, &c.kernel, &c.pool_max, &c.gqa_max,
                                     &c.pool_then_reduce, &c.n_sink, &seed, &c.alpha_safeguard, &c.safeguard,
                                     &c.pyramid_beta, &c.record_scores, &c.chunk_length, &c.reuse_layers, &c.edie_alpha, &c.drop_window))
        return NULL;
    c.budget = budget;
    c.seed = seed;
    kvc_status st = kvc_session_set_press(self->session, &c);
    if (st != KVC_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Session_cache_positions(SessionObject *self, PyObject *args) {
    int layer, head;
    if (!PyArg_ParseTuple(args, "ii", &layer, &head)) return NULL;
    if (check_session(self) < 0) return NULL;
    const int64_t n = kvc_session_cache_len(self->session, layer, head);
    if (n < 0) {
        PyErr_Format(PyExc_IndexError, "layer %d / kv head %d out of range", layer, head);
        return NULL;
    }
    npy_intp dims[1] = {n};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_INT64);
    if (!out) return NULL;
    kvc_status st = kvc_session_cache_positions(self->session, layer, head, (int64_t *)PyArray_DATA(out));
    if (st != KVC_OK) {
        Py_DECREF(out);
        return raise_status(st);
    }
    return (PyObject *)out;
}

static PyObject *Session_press_scores(SessionObject *self, PyObject *args) {
    int layer, head;
    if (!PyArg_ParseTuple(args, "ii", &layer, &head)) return NULL;
    if (check_session(self) < 0) return NULL;
    int64_t n = 0;
    kvc_status st = kvc_session_press_scores(self->session, layer, head, NULL, &n);
    if (st != KVC_OK) return raise_status(st);
    npy_intp dims[1] = {n};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_FLOAT32);
    if (!out) return NULL;
    st = kvc_session_press_scores(self->session, layer, head, (float *)PyArray_DATA(out), &n);
    if (st != KVC_OK) {
        Py_DECREF(out);
        return raise_status(st);
    }
    return (PyObject *)out;
}

static PyObject *Session_press_error(SessionObject *self, PyObject *args) {
    int layer;
    if (!PyArg_ParseTuple(args, "i", &layer)) return NULL;
    if (check_session(self) < 0) return NULL;
    double e;
    kvc_status st = kvc_session_press_error(self->session, layer, &e);
    if (st != KVC_OK) return raise_status(st);
    return PyFloat_FromDouble(e);
}

static PyObject *Session_truncate(SessionObject *self, PyObject *args) {
    PyObject *lens_obj;
    long long position;
    if (!PyArg_ParseTuple(args, "OL", &lens_obj, &position)) return NULL;
    if (check_session(self) < 0) return NULL;
    kvc_config cfg;
    kvc_model_get_config(self->model->model, &cfg);
    PyArrayObject *lens = (PyArrayObject *)PyArray_FROMANY(lens_obj, NPY_INT64, 2, 2, NPY_ARRAY_C_CONTIGUOUS);
    if (!lens) return NULL;
    if (PyArray_DIM(lens, 0) != cfg.n_layers || PyArray_DIM(lens, 1) != cfg.n_kv_heads) {
        PyErr_Format(PyExc_ValueError, "truncate: lengths must have shape (%d, %d)", cfg.n_layers, cfg.n_kv_heads);
        Py_DECREF(lens);
        return NULL;
    }
    kvc_status st = kvc_session_truncate(self->session, (const int64_t *)PyArray_DATA(lens), position);
    Py_DECREF(lens);
    if (st != KVC_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Session_copy_cache_from(SessionObject *self, PyObject *src_obj) {
    if (check_session(self) < 0) return NULL;
    if (Py_TYPE(src_obj) != Py_TYPE(self)) {
        PyErr_SetString(PyExc_TypeError, "copy_cache_from() takes a Session");
        return NULL;
    }
    SessionObject *src = (SessionObject *)src_obj;
    if (check_session(src) < 0) return NULL;
    kvc_status st;
    self->busy = src->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_session_copy_cache(self->session, src->session);
    Py_END_ALLOW_THREADS
    self->busy = src->busy = 0;
    if (st != KVC_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Session_set_layer_budgets(SessionObject *self, PyObject *arg) {
    if (check_session(self) < 0) return NULL;
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(arg, NPY_INT64, 1, 1, NPY_ARRAY_C_CONTIGUOUS);
    if (!a) return NULL;
    kvc_status st = kvc_session_set_layer_budgets(self->session, (const int64_t *)PyArray_DATA(a), (int32_t)PyArray_DIM(a, 0));
    Py_DECREF(a);
    if (st != KVC_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Session_press_layer_stats(SessionObject *self, PyObject *args) {
    int layer;
    if (!PyArg_ParseTuple(args, "i", &layer)) return NULL;
    if (check_session(self) < 0) return NULL;
    double e, dis;
    kvc_status st = kvc_session_press_layer_stats(self->session, layer, &e, &dis);
    if (st != KVC_OK) return raise_status(st);
    return Py_BuildValue("(dd)", e, dis);
}

static PyObject *Session_prefill_take(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "probe_ids", "budget", "chunk_size", "warmup_budget", "warmup_layers", "kernel",
                             "alpha", "delayed", "inner", "prompt_cached", NULL};
    PyObject *ids_obj, *probe_obj, *inner = Py_None;
    kvc_take_config c;
    kvc_take_config_defaults(&c);
    long long budget, chunk = c.chunk_size, warm = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOL|LLiifpOp", kwlist, &ids_obj, &probe_obj, &budget, &chunk, &warm,
                                     &c.warmup_layers, &c.kernel, &c.alpha, &c.delayed, &inner, &c.prompt_cached))
        return NULL;
    if (check_session(self) < 0) return NULL;
    c.budget = budget;
    c.chunk_size = chunk;
    c.warmup_budget = warm;
    if (inner != Py_None) {
        /* the inner scorer, as set_press keywords */
        PyObject *empty = PyTuple_New(0);
        if (!empty) return NULL;
        static char *ikw[] = {"scorer", "allocation", "compression_ratio", "budget", "window", "kernel", "pool_max",
                              "gqa_max", "pool_then_reduce", "n_sink", "seed", "alpha_safeguard", "safeguard",
                              "pyramid_beta", "record_scores", "chunk_length", "reuse_layers", "edie_alpha",
                              "drop_window", NULL};
        kvc_press_config *ic = &c.inner;
        long long ib = 0;
        unsigned long long seed = 0;
        int ok = PyDict_Check(inner) &&
                 PyArg_ParseTupleAndKeywords(empty, inner, "|$iidLiiiiiiKfiipiifp", ikw, &ic->scorer, &ic->allocation,
                                             &ic->compression_ratio, &ib, &ic->window, &ic->kernel, &ic->pool_max,
                                             &ic->gqa_max, &ic->pool_then_reduce, &ic->n_sink, &seed,
                                             &ic->alpha_safeguard, &ic->safeguard, &ic->pyramid_beta,
                                             &ic->record_scores, &ic->chunk_length, &ic->reuse_layers,
                                             &ic->edie_alpha, &ic->drop_window);
        Py_DECREF(empty);
        if (!ok) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "inner must be a dict of press settings");
            return NULL;
        }
        ic->seed = seed;
        c.use_inner = 1;
    }
    PyArrayObject *ids = as_ids(ids_obj);
    if (!ids) return NULL;
    PyArrayObject *probe = as_ids(probe_obj);
    if (!probe) {
        Py_DECREF(ids);
        return NULL;
    }
    c.probe_ids = (const int32_t *)PyArray_DATA(probe);
    c.n_probe = PyArray_DIM(probe, 0);
    kvc_config cfg;
    kvc_model_get_config(self->model->model, &cfg);
    npy_intp dims[1] = {cfg.vocab};
    PyArrayObject *logits = NULL; /* none when prompt_cached: the shared prefill gave them */
    if (!c.prompt_cached && !(logits = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_FLOAT32))) {
        Py_DECREF(ids);
        Py_DECREF(probe);
        return NULL;
    }
    kvc_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_session_prefill_take(self->session, (const int32_t *)PyArray_DATA(ids), PyArray_DIM(ids, 0), &c,
                                  logits ? (float *)PyArray_DATA(logits) : NULL);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    Py_DECREF(ids);
    Py_DECREF(probe);
    if (st != KVC_OK) {
        Py_XDECREF(logits);
        return raise_status(st);
    }
    if (!logits) Py_RETURN_NONE;
    return (PyObject *)logits;
}

static PyObject *Session_get_position(SessionObject *self, void *c) {
    if (!self->session) Py_RETURN_NONE;
    return PyLong_FromLongLong(kvc_session_position(self->session));
}
static PyObject *Session_get_cache_bytes(SessionObject *self, void *c) {
    if (!self->session) Py_RETURN_NONE;
    return PyLong_FromSize_t(kvc_session_cache_bytes(self->session));
}
static PyObject *Session_get_press_seconds(SessionObject *self, void *c) {
    return PyFloat_FromDouble(kvc_session_press_seconds(self->session));
}

static PyObject *Session_get_peak_cache_bytes(SessionObject *self, void *c) {
    if (!self->session) Py_RETURN_NONE;
    return PyLong_FromSize_t(kvc_session_peak_cache_bytes(self->session));
}
static PyObject *Session_get_model(SessionObject *self, void *c) {
    if (!self->model) Py_RETURN_NONE;
    return Py_NewRef((PyObject *)self->model);
}

static PyMethodDef Session_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))Session_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(ids, logits='last', embeddings=None): run tokens (then embedding rows [m, hidden]) through\n"
     "the model, appending to the cache. Returns float32 logits [vocab] ('last' or a row index),\n"
     "[n, vocab] ('all') or None ('none')."},
    {"forward_shared", (PyCFunction)(void (*)(void))Session_forward_shared, METH_VARARGS | METH_KEYWORDS,
     "forward_shared(ids, followers, logits='last'): prefill ids once; every follower Session (empty, same\n"
     "model) receives each layer's K/V and compresses it with its own attached press."},
    {"set_position", (PyCFunction)Session_set_position, METH_O, "set_position(p): the position the next token gets."},
    {"reset", (PyCFunction)Session_reset, METH_NOARGS, "Empty the cache and go back to position 0."},
    {"cache_lengths", (PyCFunction)Session_cache_lengths, METH_NOARGS, "Tokens held per (layer, kv head), int64 [L, Hkv]."},
    {"set_press", (PyCFunction)(void (*)(void))Session_set_press, METH_VARARGS | METH_KEYWORDS,
     "set_press(None) or set_press(scorer=..., allocation=..., compression_ratio=..., budget=..., ...):\n"
     "attach the press that compresses the next prefill (fields of kvc_press_config)."},
    {"cache_positions", (PyCFunction)Session_cache_positions, METH_VARARGS, "cache_positions(layer, kv_head): original positions of the kept rows (int64)."},
    {"press_scores", (PyCFunction)Session_press_scores, METH_VARARGS, "press_scores(layer, kv_head): scores of the last compression (record_scores)."},
    {"press_error", (PyCFunction)Session_press_error, METH_VARARGS, "press_error(layer): Ada-KV eviction loss on the window queries."},
    {"set_layer_budgets", (PyCFunction)Session_set_layer_budgets, METH_O, "set_layer_budgets(totals[L]): per-layer totals (KVC_ALLOC_LAYER)."},
    {"press_layer_stats", (PyCFunction)Session_press_layer_stats, METH_VARARGS, "press_layer_stats(layer) -> (E_internal, 1 - cos(R, R+O))."},
    {"prefill_take", (PyCFunction)(void (*)(void))Session_prefill_take, METH_VARARGS | METH_KEYWORDS,
     "prefill_take(ids, probe_ids, budget, chunk_size=4096, warmup_budget=0, warmup_layers=-1, kernel=7,\n"
     "alpha=0.2, delayed=True, inner=None, prompt_cached=False): TAKE chunked prefill; returns the last token's\n"
     "logits. prompt_cached: the session holds the prompt's full cache (one chunk): run only the probes, evict\n"
     "and return None."},
    {"copy_cache_from", (PyCFunction)Session_copy_cache_from, METH_O,
     "copy_cache_from(src): this empty session takes an exact copy of src's cache and position (same model\n"
     "and device); its attached press stays."},
    {"truncate", (PyCFunction)Session_truncate, METH_VARARGS, "truncate(lengths[L, Hkv], position): cut the cache back."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Session_getset[] = {
    {"position", (getter)Session_get_position, NULL, "Next token position.", NULL},
    {"cache_bytes", (getter)Session_get_cache_bytes, NULL, "Bytes the KV cache holds now.", NULL},
    {"peak_cache_bytes", (getter)Session_get_peak_cache_bytes, NULL, "Most bytes the KV cache held.", NULL},
    {"press_seconds", (getter)Session_get_press_seconds, NULL,
     "Wall seconds spent in the attached press since the last reset (CPU backend).", NULL},
    {"model", (getter)Session_get_model, NULL, "The model.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot Session_slots[] = {
    {Py_tp_doc, "Session(model, capacity=0): one sequence with its own ragged KV cache."},
    {Py_tp_init, Session_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, Session_dealloc},
    {Py_tp_traverse, Session_traverse},
    {Py_tp_clear, Session_clear},
    {Py_tp_methods, Session_methods},
    {Py_tp_getset, Session_getset},
    {0, NULL}};

static PyType_Spec Session_spec = {"kvpress_c._core.Session", sizeof(SessionObject), 0,
                                   Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
                                   Session_slots};

/* ---------------------------------------------------------------------------------------------- */
/* module functions                                                                                */

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
    if (st != KVC_OK) return raise_status(st);
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

/* Judge Q training (csrc/train/judgeq_grad.c). A pair is a PyCapsule holding a kvc_judgeq_pair (the
 * prompt's K/V and the response's attention maps); its context is a reference to the Model. */
#define JUDGEQ_PAIR_NAME "kvpress_c._core.judgeq_pair"

static void judgeq_pair_capsule_free(PyObject *cap) {
    kvc_judgeq_pair *pair = (kvc_judgeq_pair *)PyCapsule_GetPointer(cap, JUDGEQ_PAIR_NAME);
    PyObject *model = (PyObject *)PyCapsule_GetContext(cap);
    kvc_judgeq_pair_free(pair);
    Py_XDECREF(model);
}

/* judgeq_pair(model, prompt_ids, response_ids, max_soft=32) -> (pair, bytes) */
static PyObject *mod_judgeq_pair(PyObject *m, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"model", "prompt_ids", "response_ids", "max_soft", NULL};
    PyObject *model_obj, *p_obj, *r_obj;
    long long max_soft = 32;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|L", kwlist, &model_obj, &p_obj, &r_obj, &max_soft)) return NULL;
    if (!PyObject_TypeCheck(model_obj, get_state(m)->model_type)) {
        PyErr_Format(PyExc_TypeError, "judgeq_pair: model must be a kvpress_c._core.Model, not %.100s",
                     Py_TYPE(model_obj)->tp_name);
        return NULL;
    }
    ModelObject *mo = (ModelObject *)model_obj;
    if (check_model(mo) < 0) return NULL;
    PyArrayObject *pids = as_ids(p_obj), *rids = NULL;
    if (!pids) return NULL;
    if (!(rids = as_ids(r_obj))) {
        Py_DECREF(pids);
        return NULL;
    }
    kvc_judgeq_pair *pair = NULL;
    kvc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_judgeq_pair_new(mo->model, (const int32_t *)PyArray_DATA(pids), PyArray_DIM(pids, 0),
                             (const int32_t *)PyArray_DATA(rids), PyArray_DIM(rids, 0), max_soft, &pair);
    Py_END_ALLOW_THREADS
    Py_DECREF(pids);
    Py_DECREF(rids);
    if (st != KVC_OK) return raise_status(st);
    PyObject *cap = PyCapsule_New(pair, JUDGEQ_PAIR_NAME, NULL);
    if (!cap) {
        kvc_judgeq_pair_free(pair);
        return NULL;
    }
    Py_INCREF(model_obj);
    if (PyCapsule_SetContext(cap, model_obj) < 0 || PyCapsule_SetDestructor(cap, judgeq_pair_capsule_free) < 0) {
        Py_DECREF(model_obj);
        Py_DECREF(cap); /* no destructor yet: free by hand */
        kvc_judgeq_pair_free(pair);
        return NULL;
    }
    return Py_BuildValue("(Nn)", cap, (Py_ssize_t)kvc_judgeq_pair_bytes(pair));
}

/* judgeq_loss_grad(pair, soft, grad=True, maps=False) -> (loss, grad [n_soft, hidden] or None,
 * soft_maps [L, H, P] or None, response_maps or None) */
static PyObject *mod_judgeq_loss_grad(PyObject *m, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"pair", "soft", "grad", "maps", NULL};
    PyObject *pair_obj, *e_obj;
    int want_grad = 1, want_maps = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|pp", kwlist, &pair_obj, &e_obj, &want_grad, &want_maps))
        return NULL;
    if (!PyCapsule_IsValid(pair_obj, JUDGEQ_PAIR_NAME)) {
        PyErr_SetString(PyExc_TypeError, "judgeq_loss_grad: pair must come from judgeq_pair()");
        return NULL;
    }
    kvc_judgeq_pair *pair = (kvc_judgeq_pair *)PyCapsule_GetPointer(pair_obj, JUDGEQ_PAIR_NAME);
    ModelObject *mo = (ModelObject *)PyCapsule_GetContext(pair_obj);
    if (!pair || !mo) return NULL;
    kvc_config cfg;
    kvc_model_get_config(mo->model, &cfg);
    PyArrayObject *emb = NULL, *grad = NULL, *smaps = NULL, *rmaps = NULL;
    PyObject *result = NULL;
    emb = (PyArrayObject *)PyArray_FROMANY(e_obj, NPY_FLOAT32, 2, 2, NPY_ARRAY_C_CONTIGUOUS);
    if (!emb) goto done;
    if (PyArray_DIM(emb, 1) != cfg.hidden || PyArray_DIM(emb, 0) < 1) {
        PyErr_Format(PyExc_ValueError, "soft embeddings must have shape (n_soft >= 1, %d), got (%zd, %zd)", cfg.hidden,
                     (Py_ssize_t)PyArray_DIM(emb, 0), (Py_ssize_t)PyArray_DIM(emb, 1));
        goto done;
    }
    if (want_grad && !(grad = (PyArrayObject *)PyArray_SimpleNew(2, PyArray_DIMS(emb), NPY_FLOAT32))) goto done;
    if (want_maps) {
        npy_intp dims[3] = {cfg.n_layers, cfg.n_heads, (npy_intp)kvc_judgeq_pair_prompt_len(pair)};
        if (!(smaps = (PyArrayObject *)PyArray_SimpleNew(3, dims, NPY_FLOAT32)) ||
            !(rmaps = (PyArrayObject *)PyArray_SimpleNew(3, dims, NPY_FLOAT32)))
            goto done;
    }
    double loss = 0.0;
    kvc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_judgeq_pair_loss_grad(pair, (const float *)PyArray_DATA(emb), PyArray_DIM(emb, 0), &loss,
                                   grad ? (float *)PyArray_DATA(grad) : NULL, smaps ? (float *)PyArray_DATA(smaps) : NULL,
                                   rmaps ? (float *)PyArray_DATA(rmaps) : NULL);
    Py_END_ALLOW_THREADS
    if (st != KVC_OK) {
        raise_status(st);
        goto done;
    }
    result = Py_BuildValue("(dOOO)", loss, grad ? (PyObject *)grad : Py_None, smaps ? (PyObject *)smaps : Py_None,
                           rmaps ? (PyObject *)rmaps : Py_None);
done:
    Py_XDECREF(emb);
    Py_XDECREF(grad);
    Py_XDECREF(smaps);
    Py_XDECREF(rmaps);
    return result;
}

/* token_embeddings(model, ids) -> float32 [n, hidden]: input embedding rows (Judge Q initialisation). */
static PyObject *mod_token_embeddings(PyObject *m, PyObject *args) {
    PyObject *model_obj, *ids_obj;
    if (!PyArg_ParseTuple(args, "OO", &model_obj, &ids_obj)) return NULL;
    if (!PyObject_TypeCheck(model_obj, get_state(m)->model_type)) {
        PyErr_Format(PyExc_TypeError, "token_embeddings: model must be a kvpress_c._core.Model, not %.100s",
                     Py_TYPE(model_obj)->tp_name);
        return NULL;
    }
    ModelObject *mo = (ModelObject *)model_obj;
    if (check_model(mo) < 0) return NULL;
    kvc_config cfg;
    kvc_model_get_config(mo->model, &cfg);
    PyArrayObject *ids = as_ids(ids_obj);
    if (!ids) return NULL;
    npy_intp dims[2] = {PyArray_DIM(ids, 0), cfg.hidden};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    if (!out) {
        Py_DECREF(ids);
        return NULL;
    }
    kvc_status st = kvc_model_token_embeddings(mo->model, (const int32_t *)PyArray_DATA(ids), dims[0],
                                               (float *)PyArray_DATA(out));
    Py_DECREF(ids);
    if (st != KVC_OK) {
        Py_DECREF(out);
        return raise_status(st);
    }
    return (PyObject *)out;
}

/* forward_batch(sessions, ids): one decode token per session, logits [B, vocab] (kvc_forward_batch). */
static PyObject *mod_forward_batch(PyObject *m, PyObject *args) {
    PyObject *seq_obj, *ids_obj;
    if (!PyArg_ParseTuple(args, "OO", &seq_obj, &ids_obj)) return NULL;
    core_state *state = get_state(m);
    PyObject *seq = PySequence_Fast(seq_obj, "sessions must be a sequence of Session objects");
    if (!seq) return NULL;
    const Py_ssize_t B = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    kvc_session **ss = NULL;
    PyArrayObject *ids = NULL, *logits = NULL;
    Py_ssize_t marked = 0;
    if (B == 0 || B > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "forward_batch needs at least one session");
        goto done;
    }
    if (!(ss = PyMem_Calloc((size_t)B, sizeof *ss))) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < B; i++) {
        if (!PyObject_TypeCheck(items[i], state->session_type)) {
            PyErr_Format(PyExc_TypeError, "item %zd is not a Session", i);
            goto done;
        }
        SessionObject *s = (SessionObject *)items[i];
        if (check_session(s) < 0) goto done;
        if (s->model != ((SessionObject *)items[0])->model) {
            PyErr_Format(PyExc_ValueError, "session %zd belongs to another model", i);
            goto done;
        }
        ss[i] = s->session;
    }
    if (!(ids = as_ids(ids_obj))) goto done;
    if (PyArray_DIM(ids, 0) != B) {
        PyErr_Format(PyExc_ValueError, "forward_batch: %zd sessions but %zd token ids", B, (Py_ssize_t)PyArray_DIM(ids, 0));
        goto done;
    }
    kvc_config cfg;
    kvc_model_get_config(((SessionObject *)items[0])->model->model, &cfg);
    npy_intp dims[2] = {B, cfg.vocab};
    if (!(logits = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_FLOAT32))) goto done;
    kvc_status st;
    for (; marked < B; marked++) ((SessionObject *)items[marked])->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_forward_batch(ss, (int32_t)B, (const int32_t *)PyArray_DATA(ids), (float *)PyArray_DATA(logits));
    Py_END_ALLOW_THREADS
    if (st != KVC_OK) raise_status(st);
done:
    for (Py_ssize_t i = 0; i < marked; i++) ((SessionObject *)items[i])->busy = 0;
    PyMem_Free(ss);
    Py_XDECREF(ids);
    Py_DECREF(seq);
    if (PyErr_Occurred()) {
        Py_XDECREF(logits);
        return NULL;
    }
    return (PyObject *)logits;
}

/* ---- CUDA backend ---- */

static PyObject *mod_cuda_available(PyObject *m, PyObject *unused) {
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = kvc_cuda_available();
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyObject *mod_cuda_init(PyObject *m, PyObject *unused) {
    kvc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_cuda_init();
    Py_END_ALLOW_THREADS
    if (st != KVC_OK) return raise_status(st);
    return Py_BuildValue("{s:s,s:s}", "device", kvc_cuda_device_name(), "gemm", kvc_cuda_gemm_name());
}

static PyObject *mod_cuda_memory_stats(PyObject *m, PyObject *unused) {
    int64_t v[8];
    kvc_status st = kvc_cuda_memory_stats(v);
    if (st != KVC_OK) return raise_status(st);
    return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L}", "current", (long long)v[0], "peak", (long long)v[1],
                         "weights", (long long)v[2], "cache", (long long)v[3], "cache_peak", (long long)v[4],
                         "activations", (long long)v[5], "activations_peak", (long long)v[6], "device_total",
                         (long long)v[7]);
}

static PyObject *mod_cuda_reset_peak(PyObject *m, PyObject *unused) {
    kvc_status st = kvc_cuda_reset_peak();
    if (st != KVC_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"cuda_available", mod_cuda_available, METH_NOARGS, "True when libkvpress_c_cuda.so was built and a usable GPU is visible."},
    {"cuda_init", mod_cuda_init, METH_NOARGS, "Initialise the CUDA backend -> {'device', 'gemm'}; RuntimeError with the reason if it cannot."},
    {"cuda_memory_stats", mod_cuda_memory_stats, METH_NOARGS, "Device bytes of the CUDA backend (current, peak, weights, cache, activations)."},
    {"cuda_reset_peak", mod_cuda_reset_peak, METH_NOARGS, "Start the device peak counters again from the current bytes."},
    {"forward_batch", mod_forward_batch, METH_VARARGS,
     "forward_batch(sessions, ids): one token per session (no press attached), float32 logits [B, vocab];\n"
     "the weight GEMMs run once for all sessions."},
    {"set_blas", mod_set_blas, METH_VARARGS, "set_blas(path=None, symbol='scipy_cblas_sgemm'): external CBLAS sgemm or the built-in GEMM."},
    {"blas_name", mod_blas_name, METH_NOARGS, "Name of the GEMM in use."},
    {"set_num_threads", mod_set_num_threads, METH_O, "Threads of the CPU backend (<= 0: all cores)."},
    {"get_num_threads", mod_get_num_threads, METH_NOARGS, "Threads of the CPU backend."},
    {"judgeq_pair", (PyCFunction)(void (*)(void))mod_judgeq_pair, METH_VARARGS | METH_KEYWORDS,
     "judgeq_pair(model, prompt_ids, response_ids, max_soft=32) -> (pair, bytes): Judge Q training pair (one\n"
     "forward of prompt + response: the prompt's K/V and the response's attention maps, kept)."},
    {"judgeq_loss_grad", (PyCFunction)(void (*)(void))mod_judgeq_loss_grad, METH_VARARGS | METH_KEYWORDS,
     "judgeq_loss_grad(pair, soft, grad=True, maps=False) -> (loss, grad, soft_maps, response_maps): Judge Q\n"
     "loss of soft embeddings [n_soft, hidden] and dL/dsoft; maps [n_layers, n_heads, n_prompt] when maps=True."},
    {"token_embeddings", mod_token_embeddings, METH_VARARGS, "token_embeddings(model, ids) -> float32 [n, hidden] input embedding rows."},
    {NULL, NULL, 0, NULL}};

static int module_exec(PyObject *m) {
    if (_import_array() < 0) return -1;
    core_state *state = get_state(m);
    state->model_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Model_spec, NULL);
    if (!state->model_type || PyModule_AddType(m, state->model_type) < 0) return -1;
    state->session_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Session_spec, NULL);
    if (!state->session_type || PyModule_AddType(m, state->session_type) < 0) return -1;
    if (PyModule_AddStringConstant(m, "__version__", kvc_version()) < 0) return -1;
    return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
    core_state *state = get_state(m);
    Py_VISIT(state->model_type);
    Py_VISIT(state->session_type);
    return 0;
}

static int module_clear(PyObject *m) {
    core_state *state = get_state(m);
    Py_CLEAR(state->model_type);
    Py_CLEAR(state->session_type);
    return 0;
}

static void module_free(void *m) { module_clear((PyObject *)m); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL}};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvpress_c._core",
    .m_doc = "C core of kvpress_c: models, sessions with ragged KV caches, presses.",
    .m_size = sizeof(core_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&core_module); }
