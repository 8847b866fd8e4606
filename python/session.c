/* kvpress_c._core.Session: one sequence on a model's device (life cycle, forwards, the cache's state, rows and
 * positions, copy and truncate, decode graphs, a press attached by its settings), and batched decoding over
 * sessions. The methods that serve one press each are in python/presses/, assembled here at module init. */
#include "core.h"
#include <string.h>

static int Session_init(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"model", "capacity", NULL};
    PyObject *model_obj;
    long long capacity = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|L", kwlist, &model_obj, &capacity)) return -1;
    PyObject *module = PyType_GetModuleByDef(Py_TYPE(self), &kvc_core_module);
    if (!module) return -1;
    if (!PyObject_TypeCheck(model_obj, get_state(module)->model_type)) {
        PyErr_Format(PyExc_TypeError, "Session(model): model must be a kvpress_c._core.Model, not %.100s",
                     Py_TYPE(model_obj)->tp_name);
        return -1;
    }
    ModelObject *mo = (ModelObject *)model_obj;
    if (kvc_py_check_model(mo) < 0) return -1;
    if (capacity < 0) {
        PyErr_SetString(PyExc_ValueError, "capacity must be >= 0");
        return -1;
    }
    if (self->session) {
        PyErr_SetString(PyExc_RuntimeError, "Session is already initialised");
        return -1;
    }
    kvc_status st;
    Py_BEGIN_ALLOW_THREADS /* the device's lock: see attach_nogil */
    st = kvc_session_new(mo->model, capacity, &self->session);
    Py_END_ALLOW_THREADS
    if (st != KVC_OK) {
        kvc_py_raise(st);
        return -1;
    }
    Py_INCREF(mo);
    self->model = mo;
    return 0;
}

static void Session_dealloc(SessionObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Py_BEGIN_ALLOW_THREADS /* the device's lock: see attach_nogil */
    kvc_session_free(self->session);
    Py_END_ALLOW_THREADS
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

int kvc_py_check_session(SessionObject *self) {
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

static PyObject *Session_forward(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "logits", "embeddings", NULL};
    PyObject *ids_obj, *mode_obj = NULL, *emb_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OO", kwlist, &ids_obj, &mode_obj, &emb_obj)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    kvc_config cfg;
    kvc_model_get_config(self->model->model, &cfg);
    PyArrayObject *ids = NULL, *emb = NULL, *logits = NULL;
    npy_intp n_ids = 0, n_emb = 0;
    if (ids_obj != Py_None && !(PySequence_Check(ids_obj) && PySequence_Size(ids_obj) == 0)) {
        if (!(ids = kvc_py_ids(ids_obj))) return NULL;
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
    int rc;
    const int64_t pos0 = kvc_session_position(self->session);
    KVC_PY_CALL(self, rc, kvc_forward_ex(self->session, ids ? (const int32_t *)PyArray_DATA(ids) : NULL, n_ids,
                                         emb ? (const float *)PyArray_DATA(emb) : NULL, n_emb, row,
                                         logits ? (float *)PyArray_DATA(logits) : NULL));
    /* a Python press raised in a prefill from an empty session: the session is empty again, as before the call
     * (the rows earlier layers evicted were all this call's), and usable without reset() */
    if (rc < 0 && pos0 == 0 && kvc_py_press_raised()) {
        Py_BEGIN_ALLOW_THREADS /* the reset takes the device's lock, which a forward in a Python press may hold */
        kvc_session_reset(self->session);
        Py_END_ALLOW_THREADS
    }
    if (rc < 0) goto fail;
    Py_XDECREF(ids);
    Py_XDECREF(emb);
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
    if (kvc_py_check_session(self) < 0) return NULL;
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
        if (kvc_py_check_session(f) < 0) goto done;
        if (f->model != self->model) {
            PyErr_Format(PyExc_ValueError, "follower %zd belongs to another model", i);
            goto done;
        }
        fs[i] = f->session;
    }
    if (!(ids = kvc_py_ids(ids_obj))) goto done;
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
    int rc;
    for (; marked < nf; marked++) ((SessionObject *)items[marked])->busy = 1; /* the followers; self: KVC_PY_CALL */
    KVC_PY_CALL(self, rc, kvc_forward_shared(self->session, fs, (int32_t)nf, (const int32_t *)PyArray_DATA(ids), n,
                                             want_logits ? n - 1 : KVC_ROW_NONE,
                                             logits ? (float *)PyArray_DATA(logits) : NULL));
    for (Py_ssize_t i = 0; i < marked; i++) ((SessionObject *)items[i])->busy = 0;
    if (rc < 0) Py_CLEAR(logits);
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
    if (kvc_py_check_session(self) < 0) return NULL;
    long long pos = PyLong_AsLongLong(arg);
    if (pos == -1 && PyErr_Occurred()) return NULL;
    return kvc_py_none(kvc_session_set_position(self->session, pos));
}

static PyObject *Session_reset(SessionObject *self, PyObject *unused) {
    if (kvc_py_check_session(self) < 0) return NULL;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS /* the device's lock: see attach_nogil */
    kvc_session_reset(self->session);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    Py_RETURN_NONE;
}

static PyObject *Session_cache_lengths(SessionObject *self, PyObject *unused) {
    if (kvc_py_check_session(self) < 0) return NULL;
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


/* Attaching frees the press it replaces under the device's lock, which a forward running a Python press in
 * another thread may hold while it waits for the GIL: the GIL is released (KVC_PY_CALL) around it. */
static PyObject *attach_nogil(SessionObject *self, const kvc_press_spec *spec) {
    int rc;
    KVC_PY_CALL(self, rc, kvc_session_attach_press(self->session, spec));
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* set_press(None) or set_press(**settings): the same path as attach_press(PressSpec(**settings)). */
static PyObject *Session_set_press(SessionObject *self, PyObject *args, PyObject *kwds) {
    if (kvc_py_check_session(self) < 0) return NULL;
    if (PyTuple_GET_SIZE(args) == 1 && PyTuple_GET_ITEM(args, 0) == Py_None && (!kwds || PyDict_GET_SIZE(kwds) == 0))
        return attach_nogil(self, NULL);
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "set_press takes None or keyword arguments (the fields of kvc_press_config)");
        return NULL;
    }
    kvc_press_spec *spec = kvc_py_press_spec_from(kwds);
    if (!spec) return NULL;
    PyObject *res = attach_nogil(self, spec);
    kvc_press_spec_free(spec);
    return res;
}

/* attach_press(spec): a PressSpec's press compresses the next prefill (the spec is copied); None detaches. */
static PyObject *Session_attach_press(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    if (arg == Py_None) return attach_nogil(self, NULL);
    PyObject *module = PyType_GetModuleByDef(Py_TYPE(self), &kvc_core_module);
    if (!module) return NULL;
    if (!PyObject_TypeCheck(arg, get_state(module)->press_spec_type)) {
        PyErr_Format(PyExc_TypeError, "attach_press() takes a PressSpec or None, not %.100s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    return attach_nogil(self, ((PressSpecObject *)arg)->spec);
}

static PyObject *Session_get_decoding_compressions(SessionObject *self, void *c) {
    if (!self->session) Py_RETURN_NONE;
    return PyLong_FromLongLong(kvc_session_decoding_compressions(self->session));
}

static PyObject *Session_cache_positions(SessionObject *self, PyObject *args) {
    int layer, head;
    if (!PyArg_ParseTuple(args, "ii", &layer, &head)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
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
        return kvc_py_raise(st);
    }
    return (PyObject *)out;
}

static PyObject *Session_cache_rows(SessionObject *self, PyObject *args) {
    int layer, head;
    if (!PyArg_ParseTuple(args, "ii", &layer, &head)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    const int64_t n = kvc_session_cache_len(self->session, layer, head);
    if (n < 0) {
        PyErr_Format(PyExc_IndexError, "layer %d / kv head %d out of range", layer, head);
        return NULL;
    }
    kvc_config c;
    kvc_model_get_config(self->model->model, &c);
    npy_intp dims[2] = {n, c.head_dim};
    PyArrayObject *k = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    PyArrayObject *v = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    kvc_status st = KVC_OK;
    if (k && v) st = kvc_session_cache_rows(self->session, layer, head, (float *)PyArray_DATA(k), (float *)PyArray_DATA(v));
    if (!k || !v || st != KVC_OK) {
        Py_XDECREF(k);
        Py_XDECREF(v);
        return k && v ? kvc_py_raise(st) : NULL;
    }
    return Py_BuildValue("(NN)", k, v);
}

static PyObject *Session_truncate(SessionObject *self, PyObject *args) {
    PyObject *lens_obj;
    long long position;
    if (!PyArg_ParseTuple(args, "OL", &lens_obj, &position)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    kvc_config cfg;
    kvc_model_get_config(self->model->model, &cfg);
    PyArrayObject *lens = (PyArrayObject *)PyArray_FROMANY(lens_obj, NPY_INT64, 2, 2, NPY_ARRAY_C_CONTIGUOUS);
    if (!lens) return NULL;
    if (PyArray_DIM(lens, 0) != cfg.n_layers || PyArray_DIM(lens, 1) != cfg.n_kv_heads) {
        PyErr_Format(PyExc_ValueError, "truncate: lengths must have shape (%d, %d)", cfg.n_layers, cfg.n_kv_heads);
        Py_DECREF(lens);
        return NULL;
    }
    int rc__;
    KVC_PY_CALL(self, rc__, kvc_session_truncate(self->session, (const int64_t *)PyArray_DATA(lens), position));
    PyObject *res = rc__ < 0 ? NULL : Py_NewRef(Py_None);
    Py_DECREF(lens);
    return res;
}

static PyObject *Session_copy_cache_from(SessionObject *self, PyObject *src_obj) {
    if (kvc_py_check_session(self) < 0) return NULL;
    if (Py_TYPE(src_obj) != Py_TYPE(self)) {
        PyErr_SetString(PyExc_TypeError, "copy_cache_from() takes a Session");
        return NULL;
    }
    SessionObject *src = (SessionObject *)src_obj;
    if (kvc_py_check_session(src) < 0) return NULL;
    int rc;
    src->busy = 1;
    KVC_PY_CALL(self, rc, kvc_session_copy_cache(self->session, src->session));
    src->busy = 0;
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}


static PyObject *Session_set_decode_graphs(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    return kvc_py_none(kvc_session_set_decode_graphs(self->session, on));
}

static PyObject *Session_get_graph_info(SessionObject *self, void *c) {
    if (!self->session) Py_RETURN_NONE;
    int32_t on;
    int64_t steps;
    const char *error;
    kvc_status st = kvc_session_graph_info(self->session, &on, &steps, &error);
    if (st != KVC_OK) return kvc_py_raise(st);
    return Py_BuildValue("{s:O,s:L,s:s}", "enabled", on ? Py_True : Py_False, "graph_steps", (long long)steps, "error", error);
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
    {"attach_press", (PyCFunction)Session_attach_press, METH_O,
     "attach_press(spec): the PressSpec's press compresses the next prefill (a copy: changing spec later does\n"
     "not change it); None detaches. set_press(**settings) is attach_press(PressSpec(**settings))."},
    {"cache_positions", (PyCFunction)Session_cache_positions, METH_VARARGS, "cache_positions(layer, kv_head): original positions of the kept rows (int64)."},
    {"cache_rows", (PyCFunction)Session_cache_rows, METH_VARARGS,
     "cache_rows(layer, kv_head) -> (k, v): the cached key and value rows as float32 [rows, head_dim]."},
    {"copy_cache_from", (PyCFunction)Session_copy_cache_from, METH_O,
     "copy_cache_from(src): this empty session takes an exact copy of src's cache and position (same model\n"
     "and device); its attached press stays."},
    {"truncate", (PyCFunction)Session_truncate, METH_VARARGS, "truncate(lengths[L, Hkv], position): cut the cache back."},
    {"set_decode_graphs", (PyCFunction)Session_set_decode_graphs, METH_O,
     "set_decode_graphs(on): replay decode steps as a graph (devices with graphs: cuda, emulated); the first\n"
     "step after a capture is needed runs eagerly. graph_info says how many steps ran as a graph."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Session_getset[] = {
    {"position", (getter)Session_get_position, NULL, "Next token position.", NULL},
    {"cache_bytes", (getter)Session_get_cache_bytes, NULL, "Bytes the KV cache holds now.", NULL},
    {"peak_cache_bytes", (getter)Session_get_peak_cache_bytes, NULL, "Most bytes the KV cache held.", NULL},
    {"press_seconds", (getter)Session_get_press_seconds, NULL,
     "Wall seconds spent in the attached press since the last reset.", NULL},
    {"decoding_compressions", (getter)Session_get_decoding_compressions, NULL,
     "Layer compressions the decoding press made since it was attached or the session reset.", NULL},
    {"model", (getter)Session_get_model, NULL, "The model.", NULL},
    {"graph_info", (getter)Session_get_graph_info, NULL,
     "{'enabled', 'graph_steps', 'error'}: decode graphs on, steps replayed from a graph, why they were turned off.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

/* The Session's methods: its own, then each press's (python/presses/ files). A press's binding is one file and
 * one line here. */
static PyMethodDef *const session_method_tables[] = {
    Session_methods,
    kvc_py_wrapper_methods,
    kvc_py_decoding_methods,
    kvc_py_diagnostics_methods,
    kvc_py_expected_attention_methods,
    kvc_py_hub_methods,
    kvc_py_kvzip_methods,
    kvc_py_kvgrad_methods,
    kvc_py_kvcompose_methods,
    kvc_py_restorekv_methods,
    kvc_py_take_methods,
    kvc_py_persist_methods,
    kvc_py_press_scope_methods,
    kvc_py_kv_cache_methods,
    NULL};

/* the assembled table lives as long as the process (types of every module instance point to it) */
static PyMethodDef all_methods[64];

static PyType_Slot Session_slots[] = {
    {Py_tp_doc, "Session(model, capacity=0): one sequence with its own ragged KV cache."},
    {Py_tp_init, Session_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, Session_dealloc},
    {Py_tp_traverse, Session_traverse},
    {Py_tp_clear, Session_clear},
    {Py_tp_methods, all_methods},
    {Py_tp_getset, Session_getset},
    {0, NULL}};

PyType_Spec kvc_py_session_spec = {"kvpress_c._core.Session", sizeof(SessionObject), 0,
                                   Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
                                   Session_slots};

int kvc_py_session_methods_init(void) {
    if (all_methods[0].ml_name) return 0; /* made by an earlier module instance */
    size_t n = 0;
    for (PyMethodDef *const *t = session_method_tables; *t; t++)
        for (const PyMethodDef *d = *t; d->ml_name; d++) {
            for (size_t i = 0; i < n; i++)
                if (!strcmp(all_methods[i].ml_name, d->ml_name)) {
                    PyErr_Format(PyExc_SystemError, "Session method %s is bound twice", d->ml_name);
                    memset(all_methods, 0, sizeof all_methods);
                    return -1;
                }
            if (n + 1 >= sizeof all_methods / sizeof *all_methods) {
                PyErr_SetString(PyExc_SystemError, "Session: more methods than its table holds (session.c all_methods)");
                memset(all_methods, 0, sizeof all_methods);
                return -1;
            }
            all_methods[n++] = *d;
        }
    return 0;
}

/* forward_batch(sessions, ids): one decode token per session, logits [B, vocab] (kvc_forward_batch). */
PyObject *kvc_py_forward_batch(PyObject *m, PyObject *args) {
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
        if (kvc_py_check_session(s) < 0) goto done;
        if (s->model != ((SessionObject *)items[0])->model) {
            PyErr_Format(PyExc_ValueError, "session %zd belongs to another model", i);
            goto done;
        }
        ss[i] = s->session;
    }
    if (!(ids = kvc_py_ids(ids_obj))) goto done;
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
    if (st != KVC_OK) kvc_py_raise(st);
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

