/* Press settings from Python: one parser of kvc_press_config keywords (Session.set_press, TAKE's inner
 * press, the checks below), the enum codes read from the C header, and the C validation and budget
 * arithmetic the dataclasses call instead of repeating them. */
#include "core.h"

static char *press_kwlist[] = {"scorer", "allocation", "compression_ratio", "budget", "window", "kernel", "pool_max",
                               "gqa_max", "pool_then_reduce", "n_sink", "seed", "alpha_safeguard", "safeguard",
                               "pyramid_beta", "record_scores", "chunk_length", "reuse_layers", "edie_alpha",
                               "drop_window",
                               /* kvpress's scorers */
                               "lag_size", "cross_scoring", "n_future", "use_covariance", "use_vnorm", "epsilon",
                               "critical", "critical_eps", "first_stage_ratio", "attn_chunk", "sketch_dim", "cur_type", "cur_random", "cur_window",
                               "cmp_sink_start", "cmp_sink_end", "cmp_blend",
                               /* kvpress's wrappers that change the selection */
                               "chunk_press", "finch_normalize", "finch_chunk", "lazy_threshold",
                               "n_recent", "low_entropy_chunk",
                               /* value merging, CapPress, DMSPress */
                               "merge", "merge_threshold", "merge_fraction", "cap_tau",
                               "dms", "dms_threshold", "dms_window", NULL};

int kvc_py_press_config(PyObject *kwargs, kvc_press_config *c) {
    kvc_press_config_defaults(c);
    if (!kwargs) return 0;
    PyObject *empty = PyTuple_New(0);
    if (!empty) return -1;
    long long budget = 0;
    unsigned long long seed = 0;
    const int ok = PyArg_ParseTupleAndKeywords(empty, kwargs, "|$iidLiiiiiiKfiipiifpipippfpffiiipiiifipifiipfffpfi", press_kwlist, &c->scorer,
                                               &c->allocation, &c->compression_ratio, &budget, &c->window, &c->kernel,
                                               &c->pool_max, &c->gqa_max, &c->pool_then_reduce, &c->n_sink, &seed,
                                               &c->alpha_safeguard, &c->safeguard, &c->pyramid_beta, &c->record_scores,
                                               &c->chunk_length, &c->reuse_layers, &c->edie_alpha, &c->drop_window,
                                               &c->lag_size, &c->cross_scoring, &c->n_future, &c->use_covariance,
                                               &c->use_vnorm, &c->epsilon, &c->critical, &c->critical_eps,
                                               &c->first_stage_ratio, &c->attn_chunk, &c->sketch_dim, &c->cur_type,
                                               &c->cur_random, &c->cur_window, &c->cmp_sink_start, &c->cmp_sink_end,
                                               &c->cmp_blend, &c->chunk_press,
                                               &c->finch_normalize, &c->finch_chunk, &c->lazy_threshold,
                                               &c->n_recent, &c->low_entropy_chunk,
                                               &c->merge, &c->merge_threshold, &c->merge_fraction,
                                               &c->cap_tau, &c->dms, &c->dms_threshold, &c->dms_window);
    Py_DECREF(empty);
    if (!ok) return -1;
    c->budget = budget;
    c->seed = seed;
    return 0;
}

/* ---- decoding presses: the decoding fields, the rest is the base press's ---- */
int kvc_py_decoding_config(PyObject *kwargs, kvc_decoding_config *c) {
    kvc_decoding_config_defaults(c);
    PyObject *rest = kwargs ? PyDict_Copy(kwargs) : PyDict_New();
    if (!rest) return -1;
    static const char *keys[] = {"compression_interval", "target_size", "ratio_target", "target_compression_ratio",
                                 "hidden_states_buffer_size", "cam_merge_budget", "cam_seed"};
    PyObject *mine = PyDict_New();
    int r = mine ? 0 : -1;
    for (int i = 0; i < 7 && r == 0; i++) {
        PyObject *v = PyDict_GetItemString(rest, keys[i]); /* borrowed */
        if (v && (PyDict_SetItemString(mine, keys[i], v) < 0 || PyDict_DelItemString(rest, keys[i]) < 0)) r = -1;
    }
    if (r == 0) {
        static char *kw[] = {"compression_interval", "target_size", "ratio_target", "target_compression_ratio",
                             "hidden_states_buffer_size", "cam_merge_budget", "cam_seed", NULL};
        long long interval = c->compression_interval, target = c->target_size;
        unsigned long long cam_seed = 0;
        PyObject *empty = PyTuple_New(0);
        r = empty && PyArg_ParseTupleAndKeywords(empty, mine, "|$LLpdiiK", kw, &interval, &target, &c->ratio_target,
                                                 &c->target_compression_ratio, &c->hidden_states_buffer_size,
                                                 &c->cam_merge_budget, &cam_seed) ? 0 : -1;
        c->cam_seed = cam_seed;
        Py_XDECREF(empty);
        c->compression_interval = interval;
        c->target_size = target;
    }
    if (r == 0) r = kvc_py_press_config(rest, &c->base);
    Py_XDECREF(mine);
    Py_DECREF(rest);
    return r;
}

/* decoding_config_check(**settings): ValueError with the C message when kvc_decoding_config_check refuses them. */
static PyObject *mod_decoding_config_check(PyObject *m, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "decoding_config_check takes keyword arguments only");
        return NULL;
    }
    kvc_decoding_config c;
    if (kvc_py_decoding_config(kwds, &c) < 0) return NULL;
    kvc_status st = kvc_decoding_config_check(&c);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

/* press_config_check(**settings): ValueError with the C message when kvc_press_config_check refuses them. */
static PyObject *mod_press_config_check(PyObject *m, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "press_config_check takes keyword arguments only");
        return NULL;
    }
    kvc_press_config c;
    if (kvc_py_press_config(kwds, &c) < 0) return NULL;
    kvc_status st = kvc_press_config_check(&c);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

/* press_kept(n, layer=0, n_layers=1, **settings) -> tokens a head of n rows keeps */
static PyObject *mod_press_kept(PyObject *m, PyObject *args, PyObject *kwds) {
    long long n;
    int layer = 0, n_layers = 1;
    if (!PyArg_ParseTuple(args, "L|ii", &n, &layer, &n_layers)) return NULL;
    kvc_press_config c;
    if (kvc_py_press_config(kwds, &c) < 0) return NULL;
    int64_t out = 0;
    kvc_status st = kvc_press_kept(&c, layer, n_layers, n, &out);
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

/* SCORERS, ALLOCATIONS, SAFEGUARDS: name -> the C enum code (csrc/include/kvpress_c.h) */
static int add_codes(PyObject *m, const char *name, const char *const *keys, const int *codes, int n) {
    PyObject *d = PyDict_New();
    if (!d) return -1;
    for (int i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLong(codes[i]);
        if (!v || PyDict_SetItemString(d, keys[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return -1;
        }
        Py_DECREF(v);
    }
    const int r = PyModule_AddObjectRef(m, name, d);
    Py_DECREF(d);
    return r;
}

int kvc_py_press_constants(PyObject *m) {
    static const char *scorers[] = {"streaming", "knorm", "random", "tova", "observed", "snapkv", "edie",
                                    /* kvpress's scorers */
                                    "keydiff", "lagkv", "expected_attention", "non_causal_attn", "leverage", "cur", "compactor", "finch", "simlayerkv",
                                    "cap"};
    static const int scorer_codes[] = {KVC_SCORE_STREAMING, KVC_SCORE_KNORM, KVC_SCORE_RANDOM, KVC_SCORE_TOVA,
                                       KVC_SCORE_OBSERVED, KVC_SCORE_SNAPKV, KVC_SCORE_EDIE,
                                       /* kvpress's scorers */
                                       KVC_SCORE_KEYDIFF, KVC_SCORE_LAGKV, KVC_SCORE_EXPECTED, KVC_SCORE_NONCAUSAL,
                                       KVC_SCORE_LEVERAGE, KVC_SCORE_CUR, KVC_SCORE_COMPACTOR, KVC_SCORE_FINCH,
                                       KVC_SCORE_SIMLAYERKV, KVC_SCORE_CAP};
    static const char *allocations[] = {"uniform", "pyramid", "adakv", "layer"};
    static const int allocation_codes[] = {KVC_ALLOC_UNIFORM, KVC_ALLOC_PYRAMID, KVC_ALLOC_ADAKV, KVC_ALLOC_LAYER};
    static const char *safeguards[] = {"floor", "protect"};
    static const int safeguard_codes[] = {KVC_SAFEGUARD_FLOOR, KVC_SAFEGUARD_PROTECT};
    if (add_codes(m, "SCORERS", scorers, scorer_codes, (int)(sizeof scorer_codes / sizeof *scorer_codes)) < 0) return -1;
    if (add_codes(m, "ALLOCATIONS", allocations, allocation_codes, 4) < 0) return -1;
    return add_codes(m, "SAFEGUARDS", safeguards, safeguard_codes, 2);
}
