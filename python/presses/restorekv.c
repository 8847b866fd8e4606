/* RestoreKV: embedding rows run over the full cache on the host, with LoRA adapters for that pass only.
 * Session method append_embeddings. */
#include "core.h"

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

static PyObject *append_embeddings(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"embeddings", "lora", NULL};
    PyObject *emb_obj, *lora_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O", kwlist, &emb_obj, &lora_obj)) return NULL;
    if (kvc_py_check_session(self) < 0) return NULL;
    const kvc_config cfg = kvc_py_config(self);
    PyArrayObject *emb = (PyArrayObject *)PyArray_FROMANY(emb_obj, NPY_FLOAT32, 2, 2, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_FORCECAST);
    if (!emb) return NULL;
    kvc_lora *lora = NULL;
    int rc = -1;
    if (PyArray_DIM(emb, 1) != cfg.hidden || PyArray_DIM(emb, 0) < 1) {
        PyErr_Format(PyExc_ValueError, "append_embeddings: embeddings must have shape (n >= 1, %d), got (%zd, %zd)",
                     cfg.hidden, (Py_ssize_t)PyArray_DIM(emb, 0), (Py_ssize_t)PyArray_DIM(emb, 1));
        goto done;
    }
    if (lora_obj != Py_None && !(lora = lora_from(self->model->model, lora_obj))) goto done;
    KVC_PY_CALL(self, rc, kvc_session_append_embeddings(self->session, (const float *)PyArray_DATA(emb), PyArray_DIM(emb, 0),
                                                        lora));
done:
    kvc_lora_free(lora);
    Py_DECREF(emb);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

PyMethodDef kvc_py_restorekv_methods[] = {
    {"append_embeddings", (PyCFunction)(void (*)(void))append_embeddings, METH_VARARGS | METH_KEYWORDS,
     "append_embeddings(embeddings[n, hidden], lora=None): run the rows through the model on the host over the full\n"
     "cache, at the next positions, with LoRA adapters [(layer, target, A[r, in], B[out, r], scale), ...] active for\n"
     "this pass only (target: 0..6 = q, k, v, o, gate, up, down), and append their K/V (position += n)."},
    {NULL, NULL, 0, NULL}};
