/* The memory a Python press's view of a layer reads (pyscorer.c), safe however long it is held:
 *   ViewMemory  one per call: every array and DLView of the call holds it. If something still holds it when the call
 *               ends, pyscorer.c retains the view (kvc_scorer_view_retain: the K/V store continues in a copy of the
 *               rows it lent, this object keeps the old ones) and the handle is released with the last holder.
 *   DLView      a read-only tensor over that memory exported through DLPack (__dlpack__, __dlpack_device__): f32 or
 *               bf16, in host memory (kDLCPU) or the GPU's (kDLCUDA). Each export holds the ViewMemory until its
 *               consumer calls the deleter. */
#include "core.h"
#include "dlpack.h"

typedef struct {
    PyObject_HEAD
    void *handle; /* kvc_scorer_view_retain's, or NULL: the memory was the call's only */
} ViewMemoryObject;

typedef struct {
    PyObject_HEAD
    PyObject *memory;
    void *data;
    int32_t dtype; /* KVC_ROWS_* */
    int32_t host;
    int32_t ndim;
    int64_t shape[3], strides[3]; /* strides in elements */
} DLViewObject;

static PyTypeObject *view_memory_type, *dlview_type;

static void view_memory_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    kvc_scorer_view_release(((ViewMemoryObject *)self)->handle);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyType_Slot view_memory_slots[] = {
    {Py_tp_dealloc, view_memory_dealloc},
    {Py_tp_doc, "The memory of a Python press's view of one layer (kept alive by its arrays)."},
    {0, NULL}};

static PyType_Spec view_memory_spec = {"kvpress_c._core.ViewMemory", sizeof(ViewMemoryObject), 0, Py_TPFLAGS_DEFAULT,
                                       view_memory_slots};

PyObject *kvc_py_view_memory_new(void) { return PyType_GenericAlloc(view_memory_type, 0); }

void kvc_py_view_memory_keep(PyObject *memory, void *handle) { ((ViewMemoryObject *)memory)->handle = handle; }

/* ---- DLPack export ---- */

/* One export: the consumer's struct, the shape and strides it points at, and the memory it holds. */
typedef struct {
    union {
        kvc_dl_managed legacy;
        kvc_dl_managed_versioned versioned;
    } m;
    int64_t shape[3], strides[3];
    PyObject *memory;
} export_block;

static void export_free(export_block *b) {
    if (Py_IsInitialized()) { /* the consumer may let go on any thread, with or without the GIL */
        PyGILState_STATE g = PyGILState_Ensure();
        Py_XDECREF(b->memory);
        PyGILState_Release(g);
    }
    PyMem_RawFree(b);
}
static void legacy_deleter(kvc_dl_managed *m) { export_free(m->manager_ctx); }
static void versioned_deleter(kvc_dl_managed_versioned *m) { export_free(m->manager_ctx); }

/* A capsule no consumer took: its export is released here. */
static void capsule_legacy(PyObject *cap) {
    if (!PyCapsule_IsValid(cap, "dltensor")) return; /* consumed ("used_dltensor"): the consumer's deleter's */
    kvc_dl_managed *m = PyCapsule_GetPointer(cap, "dltensor");
    m->deleter(m);
}
static void capsule_versioned(PyObject *cap) {
    if (!PyCapsule_IsValid(cap, "dltensor_versioned")) return;
    kvc_dl_managed_versioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
    m->deleter(m);
}

static kvc_dl_device view_device(const DLViewObject *v) {
    const kvc_dl_device dev = {v->host ? KVC_DL_CPU : KVC_DL_CUDA, 0};
    return dev;
}

/* __dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None): a "dltensor_versioned" capsule (read-only
 * flag set) when the consumer takes DLPack 1.0 (max_version >= (1, 0)), else a "dltensor" one. The stream needs no
 * wait: the engine's work on the rows is complete before the press is called. */
static PyObject *dlview_dlpack(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOO", names, &stream, &max_version, &dl_device, &copy)) return NULL;
    DLViewObject *v = (DLViewObject *)self;
    const kvc_dl_device dev = view_device(v);
    if (copy != Py_None && PyObject_IsTrue(copy)) {
        PyErr_SetString(PyExc_BufferError, "a DLView exports its memory as it is: copy after import (copy=True refused)");
        return NULL;
    }
    if (dl_device != Py_None) {
        int type = 0, id = 0;
        if (!PyArg_ParseTuple(dl_device, "ii", &type, &id)) return NULL;
        if (type != dev.device_type || id != dev.device_id) {
            PyErr_Format(PyExc_BufferError, "a DLView stays on its device (%d, %d), not (%d, %d)", dev.device_type,
                         dev.device_id, type, id);
            return NULL;
        }
    }
    long major = 0;
    if (max_version != Py_None) {
        PyObject *first = PySequence_GetItem(max_version, 0);
        if (!first) return NULL;
        major = PyLong_AsLong(first);
        Py_DECREF(first);
        if (major == -1 && PyErr_Occurred()) return NULL;
    }
    export_block *b = PyMem_RawCalloc(1, sizeof *b);
    if (!b) return PyErr_NoMemory();
    static const float empty = 0; /* a non-NULL address for an empty view */
    kvc_dl_tensor t = {.data = v->data ? v->data : (void *)&empty, .device = dev, .ndim = v->ndim,
                       .dtype = {v->dtype == KVC_ROWS_BF16 ? KVC_DL_BFLOAT : KVC_DL_FLOAT, v->dtype == KVC_ROWS_BF16 ? 16 : 32, 1},
                       .shape = b->shape, .strides = b->strides, .byte_offset = 0};
    memcpy(b->shape, v->shape, sizeof b->shape);
    memcpy(b->strides, v->strides, sizeof b->strides);
    b->memory = Py_NewRef(v->memory);
    PyObject *cap;
    if (major >= 1) {
        b->m.versioned = (kvc_dl_managed_versioned){.version = {1, 0}, .manager_ctx = b, .deleter = versioned_deleter,
                                                    .flags = KVC_DL_FLAG_READ_ONLY, .dl_tensor = t};
        cap = PyCapsule_New(&b->m.versioned, "dltensor_versioned", capsule_versioned);
    } else {
        b->m.legacy = (kvc_dl_managed){.dl_tensor = t, .manager_ctx = b, .deleter = legacy_deleter};
        cap = PyCapsule_New(&b->m.legacy, "dltensor", capsule_legacy);
    }
    if (!cap) export_free(b);
    return cap;
}

static PyObject *dlview_dlpack_device(PyObject *self, PyObject *unused) {
    const kvc_dl_device dev = view_device((DLViewObject *)self);
    return Py_BuildValue("(ii)", dev.device_type, dev.device_id);
}

static PyObject *dlview_shape(PyObject *self, void *closure) {
    const DLViewObject *v = (DLViewObject *)self;
    PyObject *t = PyTuple_New(v->ndim);
    for (int i = 0; t && i < v->ndim; i++) PyTuple_SET_ITEM(t, i, PyLong_FromLongLong(v->shape[i]));
    return t;
}
static PyObject *dlview_dtype(PyObject *self, void *closure) {
    return PyUnicode_FromString(((DLViewObject *)self)->dtype == KVC_ROWS_BF16 ? "bfloat16" : "float32");
}
static PyObject *dlview_device(PyObject *self, void *closure) {
    return PyUnicode_FromString(((DLViewObject *)self)->host ? "cpu" : "cuda");
}
static PyObject *dlview_repr(PyObject *self) {
    PyObject *shape = dlview_shape(self, NULL);
    if (!shape) return NULL;
    const DLViewObject *v = (DLViewObject *)self;
    PyObject *r = PyUnicode_FromFormat("DLView(shape=%R, dtype=%s, device=%s)", shape,
                                       v->dtype == KVC_ROWS_BF16 ? "bfloat16" : "float32", v->host ? "cpu" : "cuda");
    Py_DECREF(shape);
    return r;
}

static void dlview_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    Py_XDECREF(((DLViewObject *)self)->memory);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef dlview_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))dlview_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None): a DLPack capsule of the view (read-only)."},
    {"__dlpack_device__", dlview_dlpack_device, METH_NOARGS, "(device type, device id): (1, 0) host, (2, 0) CUDA."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef dlview_getset[] = {
    {"shape", dlview_shape, NULL, "the view's shape", NULL},
    {"dtype", dlview_dtype, NULL, "\"float32\" or \"bfloat16\" (as the K/V store keeps it)", NULL},
    {"device", dlview_device, NULL, "\"cpu\" (host memory) or \"cuda\"", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot dlview_slots[] = {
    {Py_tp_dealloc, dlview_dealloc},
    {Py_tp_repr, dlview_repr},
    {Py_tp_methods, dlview_methods},
    {Py_tp_getset, dlview_getset},
    {Py_tp_doc, "A read-only view of engine memory for DLPack consumers: torch.from_dlpack(v), numpy.from_dlpack(v) "
                "(float32 on the host)."},
    {0, NULL}};

static PyType_Spec dlview_spec = {"kvpress_c._core.DLView", sizeof(DLViewObject), 0, Py_TPFLAGS_DEFAULT, dlview_slots};

PyObject *kvc_py_dlview_new(PyObject *memory, const void *data, int32_t dtype, int32_t host, int32_t ndim,
                            const int64_t *shape, const int64_t *strides) {
    DLViewObject *v = (DLViewObject *)PyType_GenericAlloc(dlview_type, 0);
    if (!v) return NULL;
    v->memory = Py_NewRef(memory);
    v->data = (void *)data;
    v->dtype = dtype;
    v->host = host;
    v->ndim = ndim;
    for (int i = 0; i < ndim; i++) v->shape[i] = shape[i], v->strides[i] = strides[i];
    return (PyObject *)v;
}

int kvc_py_dlview_init(PyObject *module) {
    if (!view_memory_type && !(view_memory_type = (PyTypeObject *)PyType_FromSpec(&view_memory_spec))) return -1;
    if (!dlview_type && !(dlview_type = (PyTypeObject *)PyType_FromSpec(&dlview_spec))) return -1;
    return PyModule_AddObjectRef(module, "DLView", (PyObject *)dlview_type);
}
