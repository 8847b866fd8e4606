/* Presses whose scorer takes trained weights from the hub: KVzap (set_kvzap) and
 * Fast KVzip (set_fastkvzip); QFilter and LU-KV hand theirs as press arrays (set_press_array). Each hands the attached press its weights; the
 * C core checks them against the model (sizes here, where the message names the tensor). */
#include "core.h"

/* set_kvzap(hidden_dim, w1, b1, w2=None, b2=None) */
static PyObject *set_kvzap(SessionObject *self, PyObject *args) {
    int hid;
    PyArrayObject *a[4] = {NULL, NULL, NULL, NULL};
    if (!PyArg_ParseTuple(args, "iO&O&|O&O&", &hid, kvc_py_f32_array, &a[0], kvc_py_f32_array, &a[1], kvc_py_f32_opt, &a[2],
                          kvc_py_f32_opt, &a[3]))
        return NULL;
    PyObject *res = NULL;
    if (kvc_py_check_session(self) < 0) goto done;
    const kvc_config c = kvc_py_config(self);
    const int64_t o1 = hid > 0 ? hid : c.n_kv_heads;
    const int64_t want[4] = {(int64_t)c.n_layers * o1 * c.hidden, (int64_t)c.n_layers * o1,
                             (int64_t)c.n_layers * c.n_kv_heads * o1, (int64_t)c.n_layers * c.n_kv_heads};
    for (int i = 0; i < (hid > 0 ? 4 : 2); i++)
        if (!a[i] || PyArray_SIZE(a[i]) != want[i]) {
            PyErr_Format(PyExc_ValueError, "KVzap weight %d has %lld values, this model needs %lld", i,
                         a[i] ? (long long)PyArray_SIZE(a[i]) : 0LL, (long long)want[i]);
            goto done;
        }
    int rc__;
    KVC_PY_CALL(self, rc__, kvc_session_set_kvzap(self->session, hid, (const float *)PyArray_DATA(a[0]),
                                            (const float *)PyArray_DATA(a[1]), a[2] ? (const float *)PyArray_DATA(a[2]) : NULL,
                                            a[3] ? (const float *)PyArray_DATA(a[3]) : NULL));
    res = rc__ < 0 ? NULL : Py_NewRef(Py_None);
done:
    for (int i = 0; i < 4; i++) Py_XDECREF(a[i]);
    return res;
}

/* set_fastkvzip(wq, bq, wk, q_norm, k_norm, k_base, b, n_groups, out_dim, n_base, n_sink=4, window_size=4096,
 * window_ratio=0.02, layerwise=False, norm_eps=1e-6) */
static PyObject *set_fastkvzip(SessionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"wq", "bq", "wk", "q_norm", "k_norm", "k_base", "b", "n_groups", "out_dim", "n_base",
                             "n_sink", "window_size", "window_ratio", "layerwise", "norm_eps", NULL};
    static const char *names[7] = {"FastKVzip gate q_proj.weight", "FastKVzip gate q_proj.bias",
                                   "FastKVzip gate k_proj.weight", "FastKVzip gate q_norm.weight",
                                   "FastKVzip gate k_norm.weight", "FastKVzip gate k_base", "FastKVzip gate b"};
    PyArrayObject *a[7] = {NULL};
    kvc_fastkvzip_config c = {0};
    long long window_size = 4096;
    int layerwise = 0;
    c.n_sink = 4;
    c.window_ratio = 0.02;
    c.norm_eps = 1e-6f;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O&O&O&O&O&O&iii|iLdpf", kwlist, kvc_py_f32_array, &a[0],
                                     kvc_py_f32_array, &a[1], kvc_py_f32_array, &a[2], kvc_py_f32_array, &a[3],
                                     kvc_py_f32_array, &a[4], kvc_py_f32_array, &a[5], kvc_py_f32_array, &a[6], &c.n_groups,
                                     &c.out_dim, &c.n_base, &c.n_sink, &window_size, &c.window_ratio, &layerwise,
                                     &c.norm_eps))
        return NULL;
    PyObject *res = NULL;
    if (kvc_py_check_session(self) < 0) goto done;
    c.window_size = window_size;
    c.layerwise = layerwise;
    const kvc_config mc = kvc_py_config(self);
    const int64_t L = mc.n_layers, Hkv = mc.n_kv_heads, D = mc.hidden, G = c.n_groups, od = c.out_dim, nb = c.n_base;
    const int64_t want[7] = {L * Hkv * G * od * D, L * Hkv * G * od, L * Hkv * od * D, L * od, L * od, L * Hkv * nb * od,
                             L * Hkv * G};
    for (int i = 0; i < 7; i++)
        if (kvc_py_size(a[i], names[i], want[i]) < 0) goto done;
    c.wq = PyArray_DATA(a[0]);
    c.bq = PyArray_DATA(a[1]);
    c.wk = PyArray_DATA(a[2]);
    c.q_norm = PyArray_DATA(a[3]);
    c.k_norm = PyArray_DATA(a[4]);
    c.k_base = PyArray_DATA(a[5]);
    c.b = PyArray_DATA(a[6]);
    int rc__;
    KVC_PY_CALL(self, rc__, kvc_session_set_fastkvzip(self->session, &c));
    res = rc__ < 0 ? NULL : Py_NewRef(Py_None);
done:
    for (int i = 0; i < 7; i++) Py_XDECREF(a[i]);
    return res;
}

PyMethodDef kvc_py_hub_methods[] = {
    {"set_kvzap", (PyCFunction)set_kvzap, METH_VARARGS,
     "set_kvzap(hidden_dim, w1, b1, w2=None, b2=None): KVzap scores for the attached press (KVzapPress)."},
    {"set_fastkvzip", (PyCFunction)(void (*)(void))set_fastkvzip, METH_VARARGS | METH_KEYWORDS,
     "set_fastkvzip(wq, bq, wk, q_norm, k_norm, k_base, b, n_groups, out_dim, n_base, n_sink=4, window_size=4096,\n"
     "window_ratio=0.02, layerwise=False, norm_eps=1e-6): Fast KVzip gates (stacked over layers) for the attached press."},
    {NULL, NULL, 0, NULL}};
