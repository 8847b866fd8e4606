/* Judge Q training from Python: pairs (PyCapsules holding a kvc_judgeq_pair, their context a reference to
 * the Model), the loss and gradient of soft embeddings, the token embeddings to start them from. */
#include "core.h"

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
    ModelObject *mo = kvc_py_model_arg(m, model_obj, "judgeq_pair");
    if (!mo) return NULL;
    PyArrayObject *pids = kvc_py_ids(p_obj), *rids = NULL;
    if (!pids) return NULL;
    if (!(rids = kvc_py_ids(r_obj))) {
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
    if (st != KVC_OK) return kvc_py_raise(st);
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
        kvc_py_raise(st);
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
    ModelObject *mo = kvc_py_model_arg(m, model_obj, "token_embeddings");
    if (!mo) return NULL;
    kvc_config cfg;
    kvc_model_get_config(mo->model, &cfg);
    PyArrayObject *ids = kvc_py_ids(ids_obj);
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
        return kvc_py_raise(st);
    }
    return (PyObject *)out;
}

PyMethodDef kvc_py_judgeq_methods[] = {
    {"judgeq_pair", (PyCFunction)(void (*)(void))mod_judgeq_pair, METH_VARARGS | METH_KEYWORDS,
     "judgeq_pair(model, prompt_ids, response_ids, max_soft=32) -> (pair, bytes): Judge Q training pair (one\n"
     "forward of prompt + response: the prompt's K/V and the response's attention maps, kept)."},
    {"judgeq_loss_grad", (PyCFunction)(void (*)(void))mod_judgeq_loss_grad, METH_VARARGS | METH_KEYWORDS,
     "judgeq_loss_grad(pair, soft, grad=True, maps=False) -> (loss, grad, soft_maps, response_maps): Judge Q\n"
     "loss of soft embeddings [n_soft, hidden] and dL/dsoft; maps [n_layers, n_heads, n_prompt] when maps=True."},
    {"token_embeddings", mod_token_embeddings, METH_VARARGS, "token_embeddings(model, ids) -> float32 [n, hidden] input embedding rows."},
    {NULL, NULL, 0, NULL}};
