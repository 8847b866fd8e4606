/* kvpress_c._core.Session: one sequence on a model's device, and batched decoding over sessions. */
#include "core.h"

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
    kvc_status st = kvc_session_new(mo->model, capacity, &self->session);
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
        return kvc_py_raise(st);
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
        kvc_py_raise(st);
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
    if (kvc_py_check_session(self) < 0) return NULL;
    long long pos = PyLong_AsLongLong(arg);
    if (pos == -1 && PyErr_Occurred()) return NULL;
    kvc_status st = kvc_session_set_position(self->session, pos);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Session_reset(SessionObject *self, PyObject *unused) {
    if (kvc_py_check_session(self) < 0) return NULL;
    kvc_session_reset(self->session);
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


static PyObject *Session_set_press(SessionObject *self, PyObject *args, PyObject *kwds) {
    if (kvc_py_check_session(self) < 0) return NULL;
    if (PyTuple_GET_SIZE(args) == 1 && PyTuple_GET_ITEM(args, 0) == Py_None && (!kwds || PyDict_GET_SIZE(kwds) == 0)) {
        kvc_session_set_press(self->session, NULL);
        Py_RETURN_NONE;
    }
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "set_press takes None or keyword arguments (the fields of kvc_press_config)");
        return NULL;
    }
    kvc_press_config c;
    if (kvc_py_press_config(kwds, &c) < 0) return NULL;
    kvc_status st = kvc_session_set_press(self->session, &c);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

/* wrappers: add_press(**settings) (ComposedPress), set_layer_ratios(ratios) (PerLayerCompressionPress) */
static PyObject *Session_add_press(SessionObject *self, PyObject *args, PyObject *kwds) {
    if (kvc_py_check_session(self) < 0) return NULL;
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "add_press takes keyword arguments (the fields of kvc_press_config)");
        return NULL;
    }
    kvc_press_config c;
    if (kvc_py_press_config(kwds, &c) < 0) return NULL;
    kvc_status st = kvc_session_add_press(self->session, &c);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Session_set_layer_ratios(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    PyArrayObject *r = (PyArrayObject *)PyArray_FROMANY(arg, NPY_FLOAT64, 1, 1, NPY_ARRAY_C_CONTIGUOUS);
    if (!r) return NULL;
    kvc_status st = kvc_session_set_layer_ratios(self->session, (const double *)PyArray_DATA(r), (int32_t)PyArray_DIM(r, 0));
    Py_DECREF(r);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Session_set_key_rerotation(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    kvc_status st = kvc_session_set_key_rerotation(self->session, on);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Session_set_head_budgets(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    PyArrayObject *k = (PyArrayObject *)PyArray_FROMANY(arg, NPY_INT64, 1, 2, NPY_ARRAY_C_CONTIGUOUS);
    if (!k) return NULL;
    kvc_status st = kvc_session_set_head_budgets(self->session, (const int64_t *)PyArray_DATA(k), (int64_t)PyArray_SIZE(k));
    Py_DECREF(k);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Session_set_block_size(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    const long long b = PyLong_AsLongLong(arg);
    if (b == -1 && PyErr_Occurred()) return NULL;
    kvc_status st = kvc_session_set_block_size(self->session, b);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Session_set_key_channels(SessionObject *self, PyObject *args) {
    double ratio;
    int window, free_channels = 1;
    if (!PyArg_ParseTuple(args, "di|p", &ratio, &window, &free_channels)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    kvc_status st = kvc_session_set_key_channels(self->session, ratio, window, free_channels);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Session_set_key_filters(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    PyArrayObject *f = (PyArrayObject *)PyArray_FROMANY(arg, NPY_FLOAT32, 1, 3, NPY_ARRAY_C_CONTIGUOUS);
    if (!f) return NULL;
    kvc_status st = kvc_session_set_key_filters(self->session, (const float *)PyArray_DATA(f), (int64_t)PyArray_SIZE(f));
    Py_DECREF(f);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

/* set_kvzap(hidden_dim, w1, b1, w2=None, b2=None) */
static PyObject *Session_set_kvzap(SessionObject *self, PyObject *args) {
    int hid;
    PyObject *o[4] = {NULL, NULL, Py_None, Py_None};
    if (!PyArg_ParseTuple(args, "iOO|OO", &hid, &o[0], &o[1], &o[2], &o[3])) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    PyArrayObject *a[4] = {NULL, NULL, NULL, NULL};
    for (int i = 0; i < 4; i++) {
        if (o[i] == Py_None) continue;
        a[i] = (PyArrayObject *)PyArray_FROMANY(o[i], NPY_FLOAT32, 1, 3, NPY_ARRAY_C_CONTIGUOUS);
        if (!a[i]) {
            for (int j = 0; j < i; j++) Py_XDECREF(a[j]);
            return NULL;
        }
    }
    kvc_config c;
    kvc_model_get_config(self->model->model, &c);
    const int64_t o1 = hid > 0 ? hid : c.n_kv_heads;
    const int64_t want[4] = {(int64_t)c.n_layers * o1 * c.hidden, (int64_t)c.n_layers * o1,
                             (int64_t)c.n_layers * c.n_kv_heads * o1, (int64_t)c.n_layers * c.n_kv_heads};
    kvc_status st = KVC_OK;
    for (int i = 0; i < (hid > 0 ? 4 : 2); i++)
        if (!a[i] || PyArray_SIZE(a[i]) != want[i]) {
            PyErr_Format(PyExc_ValueError, "KVzap weight %d has %lld values, this model needs %lld", i,
                         a[i] ? (long long)PyArray_SIZE(a[i]) : 0LL, (long long)want[i]);
            for (int j = 0; j < 4; j++) Py_XDECREF(a[j]);
            return NULL;
        }
    st = kvc_session_set_kvzap(self->session, hid, (const float *)PyArray_DATA(a[0]), (const float *)PyArray_DATA(a[1]),
                                   a[2] ? (const float *)PyArray_DATA(a[2]) : NULL, a[3] ? (const float *)PyArray_DATA(a[3]) : NULL);
    for (int i = 0; i < 4; i++) Py_XDECREF(a[i]);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

typedef kvc_status (*query_stats_fn)(kvc_session *, const float *, const float *, int64_t, int64_t);

/* (mean[L, H, d], cov[L, H, d, d]) handed to fn as float32 */
static PyObject *query_stats_call(SessionObject *self, PyObject *args, query_stats_fn fn) {
    PyObject *mo, *co;
    if (!PyArg_ParseTuple(args, "OO", &mo, &co)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    PyArrayObject *m = (PyArrayObject *)PyArray_FROMANY(mo, NPY_FLOAT32, 1, 3, NPY_ARRAY_C_CONTIGUOUS);
    if (!m) return NULL;
    PyArrayObject *c = (PyArrayObject *)PyArray_FROMANY(co, NPY_FLOAT32, 1, 4, NPY_ARRAY_C_CONTIGUOUS);
    if (!c) {
        Py_DECREF(m);
        return NULL;
    }
    kvc_status st = fn(self->session, (const float *)PyArray_DATA(m), (const float *)PyArray_DATA(c),
                       (int64_t)PyArray_SIZE(m), (int64_t)PyArray_SIZE(c));
    Py_DECREF(m);
    Py_DECREF(c);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Session_set_query_stats(SessionObject *self, PyObject *args) {
    return query_stats_call(self, args, kvc_session_set_query_stats);
}

static PyObject *Session_set_decoding_query_stats(SessionObject *self, PyObject *args) {
    return query_stats_call(self, args, kvc_session_set_decoding_query_stats);
}

/* set_head_ratios(prune[L, Hkv], sink, window) */
static PyObject *Session_set_head_ratios(SessionObject *self, PyObject *args) {
    PyObject *po;
    int sink, window;
    if (!PyArg_ParseTuple(args, "Oii", &po, &sink, &window)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    PyArrayObject *pr = (PyArrayObject *)PyArray_FROMANY(po, NPY_FLOAT32, 1, 2, NPY_ARRAY_C_CONTIGUOUS);
    if (!pr) return NULL;
    kvc_status st = kvc_session_set_head_ratios(self->session, (const float *)PyArray_DATA(pr), (int64_t)PyArray_SIZE(pr),
                                                sink, window);
    Py_DECREF(pr);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

/* set_fastkvzip(wq, bq, wk, q_norm, k_norm, k_base, b, n_groups, out_dim, n_base, n_sink=4, window_size=4096,
 * window_ratio=0.02, layerwise=False, norm_eps=1e-6) */
static PyObject *Session_set_fastkvzip(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"wq", "bq", "wk", "q_norm", "k_norm", "k_base", "b", "n_groups", "out_dim", "n_base",
                             "n_sink", "window_size", "window_ratio", "layerwise", "norm_eps", NULL};
    PyObject *o[7];
    kvc_fastkvzip_config c = {0};
    long long window_size = 4096;
    int layerwise = 0;
    c.n_sink = 4;
    c.window_ratio = 0.02;
    c.norm_eps = 1e-6f;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOiii|iLdpf", kwlist, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                                     &o[6], &c.n_groups, &c.out_dim, &c.n_base, &c.n_sink, &window_size, &c.window_ratio,
                                     &layerwise, &c.norm_eps))
        return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    c.window_size = window_size;
    c.layerwise = layerwise;
    kvc_config mc;
    kvc_model_get_config(self->model->model, &mc);
    const int64_t L = mc.n_layers, Hkv = mc.n_kv_heads, D = mc.hidden, G = c.n_groups, od = c.out_dim, nb = c.n_base;
    const int64_t want[7] = {L * Hkv * G * od * D, L * Hkv * G * od, L * Hkv * od * D, L * od, L * od, L * Hkv * nb * od,
                             L * Hkv * G};
    static const char *names[7] = {"q_proj.weight", "q_proj.bias", "k_proj.weight", "q_norm.weight", "k_norm.weight",
                                   "k_base", "b"};
    PyArrayObject *a[7] = {NULL};
    for (int i = 0; i < 7; i++) {
        a[i] = (PyArrayObject *)PyArray_FROMANY(o[i], NPY_FLOAT32, 0, 0, NPY_ARRAY_C_CONTIGUOUS); /* sizes checked below */
        if (a[i] && PyArray_SIZE(a[i]) != want[i])
            PyErr_Format(PyExc_ValueError, "FastKVzip gate %s has %lld values, this model needs %lld", names[i],
                         (long long)PyArray_SIZE(a[i]), (long long)want[i]);
        if (!a[i] || PyErr_Occurred()) {
            for (int j = 0; j <= i; j++) Py_XDECREF(a[j]);
            return NULL;
        }
    }
    c.wq = PyArray_DATA(a[0]);
    c.bq = PyArray_DATA(a[1]);
    c.wk = PyArray_DATA(a[2]);
    c.q_norm = PyArray_DATA(a[3]);
    c.k_norm = PyArray_DATA(a[4]);
    c.k_base = PyArray_DATA(a[5]);
    c.b = PyArray_DATA(a[6]);
    kvc_status st = kvc_session_set_fastkvzip(self->session, &c);
    for (int i = 0; i < 7; i++) Py_DECREF(a[i]);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

/* query_moments(ids, n_sink=4) -> (sum [L, H, d], outer [L, H, d, d]) float64 */
static PyObject *Session_query_moments(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "n_sink", NULL};
    PyObject *ids_obj;
    int n_sink = 4;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|i", kwlist, &ids_obj, &n_sink)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    kvc_config cfg;
    kvc_model_get_config(self->model->model, &cfg);
    PyArrayObject *ids = kvc_py_ids(ids_obj);
    if (!ids) return NULL;
    npy_intp dims[4] = {cfg.n_layers, cfg.n_heads, cfg.head_dim, cfg.head_dim};
    PyArrayObject *sum = (PyArrayObject *)PyArray_ZEROS(3, dims, NPY_FLOAT64, 0);
    PyArrayObject *outer = (PyArrayObject *)PyArray_ZEROS(4, dims, NPY_FLOAT64, 0);
    if (!sum || !outer) {
        Py_DECREF(ids);
        Py_XDECREF(sum);
        Py_XDECREF(outer);
        return NULL;
    }
    kvc_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_session_query_moments(self->session, (const int32_t *)PyArray_DATA(ids), PyArray_DIM(ids, 0), n_sink,
                                   (double *)PyArray_DATA(sum), (double *)PyArray_DATA(outer));
    Py_END_ALLOW_THREADS
    self->busy = 0;
    Py_DECREF(ids);
    if (st != KVC_OK) {
        Py_DECREF(sum);
        Py_DECREF(outer);
        return kvc_py_raise(st);
    }
    return Py_BuildValue("(NN)", sum, outer);
}

static PyObject *Session_set_decoding_press(SessionObject *self, PyObject *args, PyObject *kwds) {
    if (kvc_py_check_session(self) < 0) return NULL;
    if (PyTuple_GET_SIZE(args) == 1 && PyTuple_GET_ITEM(args, 0) == Py_None && (!kwds || PyDict_GET_SIZE(kwds) == 0)) {
        kvc_session_set_decoding_press(self->session, NULL);
        Py_RETURN_NONE;
    }
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "set_decoding_press takes None or keyword arguments (kvc_decoding_config fields "
                                         "and the base press's kvc_press_config fields)");
        return NULL;
    }
    kvc_decoding_config c;
    if (kvc_py_decoding_config(kwds, &c) < 0) return NULL;
    kvc_status st = kvc_session_set_decoding_press(self->session, &c);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
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

static PyObject *Session_press_scores(SessionObject *self, PyObject *args) {
    int layer, head;
    if (!PyArg_ParseTuple(args, "ii", &layer, &head)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    int64_t n = 0;
    kvc_status st = kvc_session_press_scores(self->session, layer, head, NULL, &n);
    if (st != KVC_OK) return kvc_py_raise(st);
    npy_intp dims[1] = {n};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_FLOAT32);
    if (!out) return NULL;
    st = kvc_session_press_scores(self->session, layer, head, (float *)PyArray_DATA(out), &n);
    if (st != KVC_OK) {
        Py_DECREF(out);
        return kvc_py_raise(st);
    }
    return (PyObject *)out;
}

static PyObject *Session_press_error(SessionObject *self, PyObject *args) {
    int layer;
    if (!PyArg_ParseTuple(args, "i", &layer)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    double e;
    kvc_status st = kvc_session_press_error(self->session, layer, &e);
    if (st != KVC_OK) return kvc_py_raise(st);
    return PyFloat_FromDouble(e);
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
    kvc_status st = kvc_session_truncate(self->session, (const int64_t *)PyArray_DATA(lens), position);
    Py_DECREF(lens);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Session_copy_cache_from(SessionObject *self, PyObject *src_obj) {
    if (kvc_py_check_session(self) < 0) return NULL;
    if (Py_TYPE(src_obj) != Py_TYPE(self)) {
        PyErr_SetString(PyExc_TypeError, "copy_cache_from() takes a Session");
        return NULL;
    }
    SessionObject *src = (SessionObject *)src_obj;
    if (kvc_py_check_session(src) < 0) return NULL;
    kvc_status st;
    self->busy = src->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_session_copy_cache(self->session, src->session);
    Py_END_ALLOW_THREADS
    self->busy = src->busy = 0;
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Session_set_layer_budgets(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(arg, NPY_INT64, 1, 1, NPY_ARRAY_C_CONTIGUOUS);
    if (!a) return NULL;
    kvc_status st = kvc_session_set_layer_budgets(self->session, (const int64_t *)PyArray_DATA(a), (int32_t)PyArray_DIM(a, 0));
    Py_DECREF(a);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Session_press_layer_stats(SessionObject *self, PyObject *args) {
    int layer;
    if (!PyArg_ParseTuple(args, "i", &layer)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    double e, dis;
    kvc_status st = kvc_session_press_layer_stats(self->session, layer, &e, &dis);
    if (st != KVC_OK) return kvc_py_raise(st);
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
    if (kvc_py_check_session(self) < 0) return NULL;
    c.budget = budget;
    c.chunk_size = chunk;
    c.warmup_budget = warm;
    if (inner != Py_None) { /* the inner scorer, as set_press keywords */
        if (!PyDict_Check(inner)) {
            PyErr_SetString(PyExc_TypeError, "inner must be a dict of press settings");
            return NULL;
        }
        if (kvc_py_press_config(inner, &c.inner) < 0) return NULL;
        c.use_inner = 1;
    }
    PyArrayObject *ids = kvc_py_ids(ids_obj);
    if (!ids) return NULL;
    PyArrayObject *probe = kvc_py_ids(probe_obj);
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
        return kvc_py_raise(st);
    }
    if (!logits) Py_RETURN_NONE;
    return (PyObject *)logits;
}

static PyObject *Session_kvzip_score(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "start", "end", "n_sink", "plus", NULL};
    PyObject *ids_obj;
    long long start, end;
    int n_sink = 4, plus = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OLL|ip", kwlist, &ids_obj, &start, &end, &n_sink, &plus)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    if (end <= start) {
        PyErr_Format(PyExc_ValueError, "kvzip_score: empty chunk [%lld, %lld)", start, end);
        return NULL;
    }
    kvc_config cfg;
    kvc_model_get_config(self->model->model, &cfg);
    PyArrayObject *ids = kvc_py_ids(ids_obj);
    if (!ids) return NULL;
    npy_intp dims[3] = {cfg.n_layers, cfg.n_kv_heads, (npy_intp)(end - start)};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(3, dims, NPY_FLOAT32);
    if (!out) {
        Py_DECREF(ids);
        return NULL;
    }
    kvc_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_session_kvzip_score(self->session, (const int32_t *)PyArray_DATA(ids), PyArray_DIM(ids, 0), start, end,
                                 n_sink, plus, (float *)PyArray_DATA(out));
    Py_END_ALLOW_THREADS
    self->busy = 0;
    Py_DECREF(ids);
    if (st != KVC_OK) {
        Py_DECREF(out);
        return kvc_py_raise(st);
    }
    return (PyObject *)out;
}

static PyObject *Session_kvzip_evict(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"scores", "compression_ratio", "layerwise", "n_sink", NULL};
    PyObject *sc_obj;
    double ratio;
    int layerwise = 0, n_sink = 4;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Od|pi", kwlist, &sc_obj, &ratio, &layerwise, &n_sink)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    kvc_config cfg;
    kvc_model_get_config(self->model->model, &cfg);
    PyArrayObject *sc = (PyArrayObject *)PyArray_FROMANY(sc_obj, NPY_FLOAT32, 3, 3, NPY_ARRAY_C_CONTIGUOUS);
    if (!sc) return NULL;
    const int64_t n = kvc_session_position(self->session), n_ctx = PyArray_DIM(sc, 2);
    if (PyArray_DIM(sc, 0) != cfg.n_layers || PyArray_DIM(sc, 1) != cfg.n_kv_heads || n_ctx < 1 || n_ctx > n) {
        PyErr_Format(PyExc_ValueError, "kvzip_evict: scores must have shape (%d, %d, n_ctx <= %lld)", cfg.n_layers,
                     cfg.n_kv_heads, (long long)n);
        Py_DECREF(sc);
        return NULL;
    }
    kvc_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    /* the rows after the scored n_ctx ones (RestoreKV's restore rows) stay */
    st = n_ctx == n ? kvc_session_kvzip_evict(self->session, (const float *)PyArray_DATA(sc), ratio, layerwise, n_sink)
                    : kvc_session_kvzip_evict_prefix(self->session, (const float *)PyArray_DATA(sc), n_ctx, ratio,
                                                     layerwise, n_sink);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    Py_DECREF(sc);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Session_kvgrad_score(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "start", "end", "n_sink", "grad_norms", NULL};
    PyObject *ids_obj;
    long long start, end;
    int n_sink = 4, want_norms = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OLL|ip", kwlist, &ids_obj, &start, &end, &n_sink, &want_norms))
        return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    if (end <= start) {
        PyErr_Format(PyExc_ValueError, "kvgrad_score: empty chunk [%lld, %lld)", start, end);
        return NULL;
    }
    kvc_config cfg;
    kvc_model_get_config(self->model->model, &cfg);
    PyArrayObject *ids = kvc_py_ids(ids_obj);
    if (!ids) return NULL;
    npy_intp dims[3] = {cfg.n_layers, cfg.n_kv_heads, (npy_intp)(end - start)}, gdims[2] = {cfg.n_layers, PyArray_DIM(ids, 0)};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(3, dims, NPY_FLOAT32);
    PyArrayObject *norms = want_norms ? (PyArrayObject *)PyArray_SimpleNew(2, gdims, NPY_FLOAT32) : NULL;
    if (!out || (want_norms && !norms)) {
        Py_DECREF(ids);
        Py_XDECREF(out);
        Py_XDECREF(norms);
        return NULL;
    }
    kvc_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_session_kvgrad_score(self->session, (const int32_t *)PyArray_DATA(ids), PyArray_DIM(ids, 0), start, end,
                                  n_sink, (float *)PyArray_DATA(out), norms ? (float *)PyArray_DATA(norms) : NULL);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    Py_DECREF(ids);
    if (st != KVC_OK) {
        Py_DECREF(out);
        Py_XDECREF(norms);
        return kvc_py_raise(st);
    }
    if (!norms) return (PyObject *)out;
    return Py_BuildValue("(NN)", out, norms);
}

/* A kvc_lora from a sequence of (layer, target, A [r, in], B [out, r], scale); NULL with an exception set. */
static kvc_lora *lora_from(kvc_model *model, PyObject *seq_obj) {
    PyObject *seq = PySequence_Fast(seq_obj, "lora must be a sequence of (layer, target, A, B, scale)");
    if (!seq) return NULL;
    kvc_lora *lora = NULL;
    kvc_status st = kvc_lora_new(model, &lora);
    if (st != KVC_OK) {
        Py_DECREF(seq);
        kvc_py_raise(st);
        return NULL;
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        int layer, target;
        float scale;
        PyObject *a_obj, *b_obj;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "iiOOf;lora entries are (layer, target, A, B, scale)",
                              &layer, &target, &a_obj, &b_obj, &scale))
            goto fail;
        PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(a_obj, NPY_FLOAT32, 2, 2, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_FORCECAST);
        PyArrayObject *b = a ? (PyArrayObject *)PyArray_FROMANY(b_obj, NPY_FLOAT32, 2, 2, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_FORCECAST) : NULL;
        if (!a || !b) {
            Py_XDECREF(a);
            goto fail;
        }
        if (PyArray_DIM(b, 1) != PyArray_DIM(a, 0) || PyArray_DIM(a, 0) > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "lora entry %zd (layer %d, target %d): A is %zd x %zd and B %zd x %zd: need A [r, "
                         "in] and B [out, r]", i, layer, target, (Py_ssize_t)PyArray_DIM(a, 0), (Py_ssize_t)PyArray_DIM(a, 1),
                         (Py_ssize_t)PyArray_DIM(b, 0), (Py_ssize_t)PyArray_DIM(b, 1));
            Py_DECREF(a);
            Py_DECREF(b);
            goto fail;
        }
        st = kvc_lora_set(lora, layer, target, (int32_t)PyArray_DIM(a, 0), PyArray_DIM(a, 1), PyArray_DIM(b, 0),
                          (const float *)PyArray_DATA(a), (const float *)PyArray_DATA(b), scale);
        Py_DECREF(a);
        Py_DECREF(b);
        if (st != KVC_OK) {
            kvc_py_raise(st);
            goto fail;
        }
    }
    Py_DECREF(seq);
    return lora;
fail:
    Py_DECREF(seq);
    kvc_lora_free(lora);
    return NULL;
}

static PyObject *Session_append_embeddings(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"embeddings", "lora", NULL};
    PyObject *emb_obj, *lora_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O", kwlist, &emb_obj, &lora_obj)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    kvc_config cfg;
    kvc_model_get_config(self->model->model, &cfg);
    PyArrayObject *emb = (PyArrayObject *)PyArray_FROMANY(emb_obj, NPY_FLOAT32, 2, 2, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_FORCECAST);
    if (!emb) return NULL;
    if (PyArray_DIM(emb, 1) != cfg.hidden || PyArray_DIM(emb, 0) < 1) {
        PyErr_Format(PyExc_ValueError, "append_embeddings: embeddings must have shape (n >= 1, %d), got (%zd, %zd)",
                     cfg.hidden, (Py_ssize_t)PyArray_DIM(emb, 0), (Py_ssize_t)PyArray_DIM(emb, 1));
        Py_DECREF(emb);
        return NULL;
    }
    kvc_lora *lora = NULL;
    if (lora_obj != Py_None && !(lora = lora_from(self->model->model, lora_obj))) {
        Py_DECREF(emb);
        return NULL;
    }
    kvc_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_session_append_embeddings(self->session, (const float *)PyArray_DATA(emb), PyArray_DIM(emb, 0), lora);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    kvc_lora_free(lora);
    Py_DECREF(emb);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Session_kvcompose_profile(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "sum", NULL};
    PyObject *ids_obj;
    int sum = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|p", kwlist, &ids_obj, &sum)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    kvc_config cfg;
    kvc_model_get_config(self->model->model, &cfg);
    PyArrayObject *ids = kvc_py_ids(ids_obj);
    if (!ids) return NULL;
    npy_intp dims[3] = {cfg.n_layers, cfg.n_heads, (npy_intp)kvc_session_position(self->session)};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(3, dims, NPY_FLOAT32);
    if (!out) {
        Py_DECREF(ids);
        return NULL;
    }
    kvc_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_session_kvcompose_profile(self->session, (const int32_t *)PyArray_DATA(ids), PyArray_DIM(ids, 0), sum,
                                       (float *)PyArray_DATA(out));
    Py_END_ALLOW_THREADS
    self->busy = 0;
    Py_DECREF(ids);
    if (st != KVC_OK) {
        Py_DECREF(out);
        return kvc_py_raise(st);
    }
    return (PyObject *)out;
}

static PyObject *Session_kvcompose_evict(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"task", "compression_ratio", "structured", "group_max", "head_max", "add_v_norm",
                             "add_mean", "lower_bound", NULL};
    PyObject *sc_obj;
    double ratio;
    int structured = 1, group_max = 0, head_max = 0, add_v_norm = 0, add_mean = 1;
    long long lower_bound = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Od|pppppL", kwlist, &sc_obj, &ratio, &structured, &group_max,
                                     &head_max, &add_v_norm, &add_mean, &lower_bound))
        return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    kvc_config cfg;
    kvc_model_get_config(self->model->model, &cfg);
    PyArrayObject *sc = (PyArrayObject *)PyArray_FROMANY(sc_obj, NPY_FLOAT32, 3, 3, NPY_ARRAY_C_CONTIGUOUS);
    if (!sc) return NULL;
    const int64_t n = kvc_session_position(self->session);
    if (PyArray_DIM(sc, 0) != cfg.n_layers || PyArray_DIM(sc, 1) != cfg.n_heads || PyArray_DIM(sc, 2) != n) {
        PyErr_Format(PyExc_ValueError, "kvcompose_evict: task scores must have shape (%d, %d, %lld)", cfg.n_layers,
                     cfg.n_heads, (long long)n);
        Py_DECREF(sc);
        return NULL;
    }
    kvc_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_session_kvcompose_evict(self->session, (const float *)PyArray_DATA(sc), ratio, structured, group_max,
                                     head_max, add_v_norm, add_mean, lower_bound);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    Py_DECREF(sc);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Session_set_decode_graphs(SessionObject *self, PyObject *arg) {
    if (kvc_py_check_session(self) < 0) return NULL;
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    kvc_status st = kvc_session_set_decode_graphs(self->session, on);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
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
    {"add_press", (PyCFunction)(void (*)(void))Session_add_press, METH_VARARGS | METH_KEYWORDS,
     "add_press(scorer=..., ...): a press that compresses, layer by layer, what the attached press kept (ComposedPress)."},
    {"set_layer_ratios", (PyCFunction)Session_set_layer_ratios, METH_O,
     "set_layer_ratios(ratios[L]): each layer's compression_ratio for the attached press (PerLayerCompressionPress)."},
    {"set_key_rerotation", (PyCFunction)Session_set_key_rerotation, METH_O,
     "set_key_rerotation(on): the attached press re-rotates kept keys to positions 0 .. n_kept - 1 (KeyRerotationPress)."},
    {"set_head_budgets", (PyCFunction)Session_set_head_budgets, METH_O,
     "set_head_budgets(keep[L, Hkv]): rows each head keeps (-1: all) instead of the press budget (DuoAttention)."},
    {"set_block_size", (PyCFunction)Session_set_block_size, METH_O,
     "set_block_size(b): the attached press selects block by block (BlockPress); 0 turns it off."},
    {"set_key_channels", (PyCFunction)Session_set_key_channels, METH_VARARGS,
     "set_key_channels(ratio, window, free_channels=True): ThinK key-channel pruning by the attached press\n"
     "(free_channels: pruned keys stored with the kept channels only; False: channels zeroed in place)."},
    {"set_key_filters", (PyCFunction)Session_set_key_filters, METH_O,
     "set_key_filters(filters[L, Hkv, d]): Q-filter scores -<k, filter> for the attached press (QFilterPress)."},
    {"set_kvzap", (PyCFunction)Session_set_kvzap, METH_VARARGS,
     "set_kvzap(hidden_dim, w1, b1, w2=None, b2=None): KVzap scores for the attached press (KVzapPress)."},
    {"set_query_stats", (PyCFunction)Session_set_query_stats, METH_VARARGS,
     "set_query_stats(mean[L, H, d], cov[L, H, d, d]): given pre-RoPE query statistics for the attached\n"
     "ExpectedAttention press (ExpectedAttentionStatsPress), in this model's channel order."},
    {"set_decoding_query_stats", (PyCFunction)Session_set_decoding_query_stats, METH_VARARGS,
     "set_decoding_query_stats(mean[L, H, d], cov[L, H, d, d]): the same for the decoding press (its base an\n"
     "ExpectedAttention press): the given statistics instead of the buffered queries'."},
    {"set_head_ratios", (PyCFunction)Session_set_head_ratios, METH_VARARGS,
     "set_head_ratios(prune[L, Hkv], sink, window): LU-KV's per-head prune ratios for the attached press's scorer."},
    {"set_fastkvzip", (PyCFunction)(void (*)(void))Session_set_fastkvzip, METH_VARARGS | METH_KEYWORDS,
     "set_fastkvzip(wq, bq, wk, q_norm, k_norm, k_base, b, n_groups, out_dim, n_base, n_sink=4, window_size=4096,\n"
     "window_ratio=0.02, layerwise=False, norm_eps=1e-6): Fast KVzip gates (stacked over layers) for the attached press."},
    {"query_moments", (PyCFunction)(void (*)(void))Session_query_moments, METH_VARARGS | METH_KEYWORDS,
     "query_moments(ids, n_sink=4) -> (sum[L, H, d], outer[L, H, d, d]): the pre-RoPE queries after the first n_sink\n"
     "of a forward of ids on this empty session, summed and their products summed (float64); the session is reset."},
    {"set_decoding_press", (PyCFunction)(void (*)(void))Session_set_decoding_press, METH_VARARGS | METH_KEYWORDS,
     "set_decoding_press(None) or set_decoding_press(compression_interval=..., target_size=..., ratio_target=...,\n"
     "target_compression_ratio=..., hidden_states_buffer_size=..., scorer=..., ...): compress while decoding."},
    {"cache_positions", (PyCFunction)Session_cache_positions, METH_VARARGS, "cache_positions(layer, kv_head): original positions of the kept rows (int64)."},
    {"cache_rows", (PyCFunction)Session_cache_rows, METH_VARARGS,
     "cache_rows(layer, kv_head) -> (k, v): the cached key and value rows as float32 [rows, head_dim]."},
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
    {"kvzip_score", (PyCFunction)(void (*)(void))Session_kvzip_score, METH_VARARGS | METH_KEYWORDS,
     "kvzip_score(ids, start, end, n_sink=4, plus=False) -> float32 [L, Hkv, end - start]: KVzip's scores of the\n"
     "context rows [start, end) from the reconstruction tokens ids, run on the session's full context cache\n"
     "(their rows are dropped again)."},
    {"kvcompose_profile", (PyCFunction)(void (*)(void))Session_kvcompose_profile, METH_VARARGS | METH_KEYWORDS,
     "kvcompose_profile(ids, sum=False) -> float32 [L, H, n]: per attention head and context row, the maximum (or sum)\n"
     "over the prompt ids' queries, run on the full context cache, of their attention (KVCompose's statistics)."},
    {"kvcompose_evict", (PyCFunction)(void (*)(void))Session_kvcompose_evict, METH_VARARGS | METH_KEYWORDS,
     "kvcompose_evict(task[L, H, n], compression_ratio, structured=True, group_max=False, head_max=False,\n"
     "add_v_norm=False, add_mean=True, lower_bound=0): KVCompose's eviction of the full context cache."},
    {"kvzip_evict", (PyCFunction)(void (*)(void))Session_kvzip_evict, METH_VARARGS | METH_KEYWORDS,
     "kvzip_evict(scores[L, Hkv, n], compression_ratio, layerwise=False, n_sink=4): KVzip's eviction of the full cache;\n"
     "n < position: only the first n rows are scored and may go (the rest stay), compression_ratio in [0, 1]."},
    {"kvgrad_score", (PyCFunction)(void (*)(void))Session_kvgrad_score, METH_VARARGS | METH_KEYWORDS,
     "kvgrad_score(ids, start, end, n_sink=4, grad_norms=False) -> float32 [L, Hkv, end - start] (and with grad_norms\n"
     "the float32 [L, len(ids)] norms ||dPhi/da||): KVgrad's scores of the chunk [start, end) of the full cache from\n"
     "the reconstruction prompt ids (host forward and backward; the cache is not changed)."},
    {"append_embeddings", (PyCFunction)(void (*)(void))Session_append_embeddings, METH_VARARGS | METH_KEYWORDS,
     "append_embeddings(embeddings[n, hidden], lora=None): run the rows through the model on the host over the full\n"
     "cache, at the next positions, with LoRA adapters [(layer, target, A[r, in], B[out, r], scale), ...] active for\n"
     "this pass only (target: 0..6 = q, k, v, o, gate, up, down), and append their K/V (position += n)."},
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

PyType_Spec kvc_py_session_spec = {"kvpress_c._core.Session", sizeof(SessionObject), 0,
                                   Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
                                   Session_slots};

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

