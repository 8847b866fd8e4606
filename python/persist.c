/* Saved caches: Session.save / Session.load, and the module's cache_file_metadata and model_digest
 * (csrc/persist/; the Python side is kvpress_c/saved.py). */
#include "core.h"

/* A {str: str} dict -> parallel UTF-8 arrays (borrowed from the dict's str objects); -1 with TypeError. */
static int meta_arrays(PyObject *meta, Py_ssize_t *n, const char ***keys, const char ***values) {
    *n = 0;
    *keys = *values = NULL;
    if (!meta || meta == Py_None) return 0;
    if (!PyDict_Check(meta)) {
        PyErr_SetString(PyExc_TypeError, "metadata must be a dict of str -> str");
        return -1;
    }
    const Py_ssize_t m = PyDict_GET_SIZE(meta);
    *keys = PyMem_Calloc((size_t)(m ? m : 1), sizeof(char *));
    *values = PyMem_Calloc((size_t)(m ? m : 1), sizeof(char *));
    if (!*keys || !*values) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(meta, &pos, &k, &v)) {
        if (!PyUnicode_Check(k) || !PyUnicode_Check(v)) {
            PyErr_SetString(PyExc_TypeError, "metadata must be a dict of str -> str");
            return -1;
        }
        Py_ssize_t nk, nv;
        if (!((*keys)[*n] = PyUnicode_AsUTF8AndSize(k, &nk)) || !((*values)[*n] = PyUnicode_AsUTF8AndSize(v, &nv)))
            return -1;
        if (strlen((*keys)[*n]) != (size_t)nk || strlen((*values)[*n]) != (size_t)nv) {
            PyErr_SetString(PyExc_ValueError, "metadata strings must not contain NUL characters");
            return -1;
        }
        (*n)++;
    }
    return 0;
}

static PyObject *Session_save(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path", "metadata", NULL};
    PyObject *path = NULL, *meta = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|O", kwlist, PyUnicode_FSConverter, &path, &meta)) return NULL;
    Py_ssize_t n = 0;
    const char **keys = NULL, **values = NULL;
    int rc = -1;
    if (kvc_py_check_session(self) == 0 && meta_arrays(meta, &n, &keys, &values) == 0) {
        if (n > INT32_MAX) PyErr_SetString(PyExc_ValueError, "too many metadata entries");
        else KVC_PY_CALL(self, rc, kvc_session_save(self->session, PyBytes_AS_STRING(path), (int32_t)n, keys, values));
    }
    PyMem_Free(keys);
    PyMem_Free(values);
    Py_DECREF(path);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* O& converter: None, or a K/V format triple (kvc_py_kv_format) */
typedef struct {
    kvc_kv_format f;
    int given;
} optional_format;

static int optional_format_conv(PyObject *obj, void *out) {
    optional_format *o = out;
    o->given = obj != Py_None;
    return obj == Py_None || kvc_py_kv_format(obj, &o->f);
}

static PyObject *Session_load(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path", "kv_format", NULL};
    PyObject *path = NULL;
    optional_format as = {.given = 0};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|O&", kwlist, PyUnicode_FSConverter, &path, optional_format_conv, &as))
        return NULL;
    int rc = -1;
    if (kvc_py_check_session(self) == 0) KVC_PY_CALL(self, rc, kvc_session_load_as(self->session, PyBytes_AS_STRING(path), as.given ? &as.f : NULL));
    Py_DECREF(path);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

PyMethodDef kvc_py_persist_methods[] = {
    {"save", (PyCFunction)(void (*)(void))Session_save, METH_VARARGS | METH_KEYWORDS,
     "save(path, metadata=None): write the cache exactly to a safetensors file, with the attached presses' state\n"
     "(a decoding press's counters and buffered queries mid-answer; metadata: str -> str pairs that ride along;\n"
     "keys starting with 'kvc.' are the file's own)."},
    {"load", (PyCFunction)(void (*)(void))Session_load, METH_VARARGS | METH_KEYWORDS,
     "load(path, kv_format=None): fill this empty session from a saved cache, its rows in the file's K/V type, or\n"
     "in kv_format's (a (type, group, residual) triple: kvpress_c.kv_cache.kv_format); the presses attached to it\n"
     "receive the state the file holds for them (ValueError saying why for another model, an older or newer format version, a state\n"
     "a press of other settings kept, a truncated or corrupt file)."},
    {NULL, NULL, 0, NULL}};

static PyObject *mod_cache_file_metadata(PyObject *m, PyObject *arg) {
    PyObject *path = NULL;
    if (!PyUnicode_FSConverter(arg, &path)) return NULL;
    size_t need = 0;
    kvc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_cache_file_metadata(PyBytes_AS_STRING(path), NULL, 0, &need);
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    char *buf = st == KVC_OK ? PyMem_Malloc(need) : NULL;
    if (st != KVC_OK) kvc_py_raise(st);
    else if (!buf) PyErr_NoMemory();
    else if ((st = kvc_cache_file_metadata(PyBytes_AS_STRING(path), buf, need, &need)) != KVC_OK) kvc_py_raise(st);
    else out = PyUnicode_FromString(buf);
    PyMem_Free(buf);
    Py_DECREF(path);
    return out;
}

static PyObject *mod_model_digest(PyObject *m, PyObject *arg) {
    ModelObject *mo = kvc_py_model_arg(m, arg, "model_digest");
    if (!mo || kvc_py_check_model(mo) < 0) return NULL;
    char out[72];
    kvc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_model_digest(mo->model, out, sizeof out);
    Py_END_ALLOW_THREADS
    if (st != KVC_OK) return kvc_py_raise(st);
    return PyUnicode_FromString(out);
}

PyMethodDef kvc_py_persist_module_methods[] = {
    {"cache_file_metadata", (PyCFunction)mod_cache_file_metadata, METH_O,
     "cache_file_metadata(path): a saved cache's metadata, checked, as a JSON object of strings."},
    {"model_digest", (PyCFunction)mod_model_digest, METH_O,
     "model_digest(model): 'sha256:...' of the model's weight files (the identity a saved cache records)."},
    {NULL, NULL, 0, NULL}};
