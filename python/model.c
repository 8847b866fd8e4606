/* kvpress_c._core.Model: a model file loaded onto a device. */
#include "core.h"

int kvc_py_device(const char *name) {
    if (!strcmp(name, "cpu")) return KVC_DEVICE_CPU;
    if (!strcmp(name, "cuda") || !strcmp(name, "cuda:0")) return KVC_DEVICE_CUDA;
    if (!strcmp(name, "emulated")) return KVC_DEVICE_EMULATED;
    PyErr_Format(PyExc_ValueError, "device must be 'cpu', 'cuda' or 'emulated', got '%s'", name);
    return -1;
}

ModelObject *kvc_py_model_arg(PyObject *module, PyObject *obj, const char *who) {
    if (!PyObject_TypeCheck(obj, get_state(module)->model_type)) {
        PyErr_Format(PyExc_TypeError, "%s: model must be a kvpress_c._core.Model, not %.100s", who, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    ModelObject *mo = (ModelObject *)obj;
    return kvc_py_check_model(mo) < 0 ? NULL : mo;
}

static int Model_init(ModelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path", "device", "weights", "mmap", "repack", NULL};
    PyObject *path_obj = NULL;
    const char *device = "cpu", *weights = "native";
    int mmap = 1, repack = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|sspp", kwlist, PyUnicode_FSConverter, &path_obj, &device, &weights, &mmap,
                                     &repack))
        return -1;
    const int dev = kvc_py_device(device);
    if (dev < 0) {
        Py_DECREF(path_obj);
        return -1;
    }
    const int wmode = !strcmp(weights, "native") ? KVC_WEIGHTS_NATIVE : !strcmp(weights, "fp32") ? KVC_WEIGHTS_FP32 : -1;
    if (wmode < 0) {
        PyErr_Format(PyExc_ValueError, "weights must be 'native' (the file's types) or 'fp32', got '%s'", weights);
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
    const int32_t flags = wmode != KVC_WEIGHTS_NATIVE ? 0 : (!mmap ? KVC_WEIGHTS_NO_MMAP : 0) | (!repack ? KVC_WEIGHTS_NO_REPACK : 0);
    st = kvc_model_load_ex(path, dev, wmode | flags, &m);
    Py_END_ALLOW_THREADS
    if (st != KVC_OK) {
        Py_DECREF(path_obj);
        if (dev != KVC_DEVICE_CPU && st == KVC_ERR_DEVICE)
            PyErr_Format(PyExc_RuntimeError, "%s; use device='cpu'", kvc_last_error());
        else
            kvc_py_raise(st);
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

int kvc_py_check_model(ModelObject *self) {
    if (!self->model) {
        PyErr_SetString(PyExc_RuntimeError, "Model is not loaded");
        return -1;
    }
    return 0;
}

static PyObject *Model_get_config(ModelObject *self, void *closure) {
    if (kvc_py_check_model(self) < 0) return NULL;
    kvc_config c;
    kvc_model_get_config(self->model, &c);
    static const char *arch_names[] = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "gemma2", "qwen3_moe", "mixtral"};
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    SET_ITEM(d, "arch", PyUnicode_FromString(c.arch >= 0 && c.arch <= KVC_ARCH_MIXTRAL ? arch_names[c.arch] : "?"));
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
    SET_ITEM(d, "qk_norm", PyBool_FromLong(c.qk_norm));
    SET_ITEM(d, "sliding_window", PyLong_FromLong(c.sliding_window));
    SET_ITEM(d, "window_first_layer", PyLong_FromLong(c.window_first_layer));
    SET_ITEM(d, "rms_eps", PyFloat_FromDouble(c.rms_eps));
    SET_ITEM(d, "rope_theta", PyFloat_FromDouble(c.rope_theta));
    SET_ITEM(d, "rope_scaling_factor", PyFloat_FromDouble(c.rope_scaling_factor));
    SET_ITEM(d, "rope_dim", PyLong_FromLong(c.rope_dim > 0 ? c.rope_dim : c.head_dim));
    SET_ITEM(d, "rope_long_context", PyLong_FromLong(c.rope_long_context));
    SET_ITEM(d, "rope_attn_factor", PyFloat_FromDouble(c.rope_attn_factor > 0 ? c.rope_attn_factor : 1.0));
    SET_ITEM(d, "window_period", PyLong_FromLong(c.window_period));
    SET_ITEM(d, "rope_local_theta", PyFloat_FromDouble(c.rope_local_theta));
    SET_ITEM(d, "attn_scale", PyFloat_FromDouble(c.attn_scale));
    SET_ITEM(d, "embed_scale", PyFloat_FromDouble(c.embed_scale));
    SET_ITEM(d, "mlp_act", PyUnicode_FromString(c.mlp_act == KVC_MLP_GELU_TANH ? "gelu_tanh" : "silu"));
    SET_ITEM(d, "post_norms", PyBool_FromLong(c.post_norms));
    SET_ITEM(d, "attn_softcap", PyFloat_FromDouble(c.attn_softcap));
    SET_ITEM(d, "logit_softcap", PyFloat_FromDouble(c.logit_softcap));
    SET_ITEM(d, "n_experts", PyLong_FromLong(c.n_experts));
    SET_ITEM(d, "n_experts_used", PyLong_FromLong(c.n_experts_used));
    SET_ITEM(d, "moe_ffn", PyLong_FromLong(c.moe_ffn));
    SET_ITEM(d, "moe_norm_topk", PyBool_FromLong(c.moe_norm_topk));
    PyObject *moe_layers = PyList_New(0); /* the layers whose MLP is a mixture of experts */
    if (!moe_layers) {
        Py_DECREF(d);
        return NULL;
    }
    for (int32_t l = 0; l < c.n_layers; l++) {
        const int moe = kvc_model_layer_moe(self->model, l);
        PyObject *v = moe ? PyLong_FromLong(l) : NULL;
        if (moe && (!v || PyList_Append(moe_layers, v) < 0)) {
            Py_XDECREF(v);
            Py_DECREF(moe_layers);
            Py_DECREF(d);
            return NULL;
        }
        Py_XDECREF(v);
    }
    SET_ITEM(d, "moe_layers", moe_layers);
    SET_ITEM(d, "bos_id", PyLong_FromLong(c.bos_id));
    SET_ITEM(d, "eos_id", PyLong_FromLong(c.eos_id));
    SET_ITEM(d, "format", PyUnicode_FromString(kvc_model_format(self->model)));
    SET_ITEM(d, "weight_bytes", PyLong_FromSize_t(kvc_model_weight_bytes(self->model)));
    SET_ITEM(d, "mapped_bytes", PyLong_FromSize_t(kvc_model_mapped_bytes(self->model)));
    int32_t n_native = 0;
    const int32_t wm = kvc_model_weights(self->model, &n_native);
    SET_ITEM(d, "weights", PyUnicode_FromString(wm == KVC_WEIGHTS_FP32 ? "fp32" : "native"));
    SET_ITEM(d, "native_matrices", PyLong_FromLong(n_native));
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
        return kvc_py_raise(st);
    }
    return list;
}

static PyObject *Model_metadata(ModelObject *self, PyObject *unused) {
    if (kvc_py_check_model(self) < 0) return NULL;
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
            return kvc_py_raise(st);
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
    if (kvc_py_check_model(self) < 0) return NULL;
    static const char *names[] = {"cpu", "cuda", "emulated"};
    return PyUnicode_FromString(names[kvc_model_device(self->model)]);
}

static PyObject *Model_get_path(ModelObject *self, void *closure) {
    if (!self->path) Py_RETURN_NONE;
    return Py_NewRef(self->path);
}

static PyObject *Model_set_kv_format(ModelObject *self, PyObject *arg) {
    kvc_kv_format f;
    if (kvc_py_check_model(self) < 0 || !kvc_py_kv_format(arg, &f)) return NULL;
    const kvc_status st = kvc_model_set_kv_format(self->model, &f);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *Model_kv_format(ModelObject *self, PyObject *unused) {
    if (kvc_py_check_model(self) < 0) return NULL;
    kvc_kv_format f;
    kvc_model_get_kv_format(self->model, &f);
    return kvc_py_kv_format_tuple(&f);
}

static PyMethodDef Model_methods[] = {
    {"set_kv_format", (PyCFunction)Model_set_kv_format, METH_O,
     "set_kv_format((type, group, residual)): the K/V storage type new sessions get (kvpress_c.kv_cache)."},
    {"kv_format", (PyCFunction)Model_kv_format, METH_NOARGS, "(type, group, residual) new sessions get (type -1: native)."},
    {"metadata", (PyCFunction)Model_metadata, METH_NOARGS, "GGUF metadata as a dict (empty for safetensors)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Model_getset[] = {
    {"config", (getter)Model_get_config, NULL, "Model configuration (dict).", NULL},
    {"path", (getter)Model_get_path, NULL, "Path the model was loaded from.", NULL},
    {"device", (getter)Model_get_device, NULL, "'cpu', 'cuda' or 'emulated': where the model's sessions run.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot Model_slots[] = {
    {Py_tp_doc, "Model(path, device='cpu'): a GGUF file or Hugging Face folder loaded onto a device of the C core."},
    {Py_tp_init, Model_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, Model_dealloc},
    {Py_tp_traverse, Model_traverse},
    {Py_tp_methods, Model_methods},
    {Py_tp_getset, Model_getset},
    {0, NULL}};

PyType_Spec kvc_py_model_spec = {"kvpress_c._core.Model", sizeof(ModelObject), 0,
                                 Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
                                 Model_slots};

