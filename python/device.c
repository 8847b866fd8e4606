/* Devices from Python: availability (with the reason when not), what a device is (name, GEMM), its
 * memory counters and settings. */
#include "core.h"

static int device_arg(PyObject *args, int32_t *out) {
    const char *name = "cuda";
    if (!PyArg_ParseTuple(args, "|s", &name)) return -1;
    const int d = kvc_py_device(name);
    if (d < 0) return -1;
    *out = d;
    return 0;
}

static PyObject *mod_device_available(PyObject *m, PyObject *args) {
    int32_t d;
    if (device_arg(args, &d) < 0) return NULL;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = kvc_device_available(d);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

/* device_info(device='cuda') -> {'device', 'gemm'}: RuntimeError with the reason when it cannot run */
static PyObject *mod_device_info(PyObject *m, PyObject *args) {
    int32_t d;
    if (device_arg(args, &d) < 0) return NULL;
    kvc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kvc_device_init(d);
    Py_END_ALLOW_THREADS
    if (st != KVC_OK) return kvc_py_raise(st);
    return Py_BuildValue("{s:s,s:s}", "device", kvc_device_name(d), "gemm", kvc_device_gemm_name(d));
}

static PyObject *mod_memory_stats(PyObject *m, PyObject *args) {
    int32_t d;
    if (device_arg(args, &d) < 0) return NULL;
    int64_t v[8];
    kvc_status st = kvc_device_memory_stats(d, v);
    if (st != KVC_OK) return kvc_py_raise(st);
    return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L}", "current", (long long)v[0], "peak", (long long)v[1],
                         "weights", (long long)v[2], "cache", (long long)v[3], "cache_peak", (long long)v[4],
                         "activations", (long long)v[5], "activations_peak", (long long)v[6], "device_total",
                         (long long)v[7]);
}

static PyObject *mod_reset_peak(PyObject *m, PyObject *args) {
    int32_t d;
    if (device_arg(args, &d) < 0) return NULL;
    kvc_status st = kvc_device_reset_peak(d);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

/* a device name as an O& converter */
static int device_conv(PyObject *obj, void *out) {
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "device must be a str, not %s", Py_TYPE(obj)->tp_name);
        return 0;
    }
    const char *name = PyUnicode_AsUTF8(obj);
    const int d = name ? kvc_py_device(name) : -1;
    if (d < 0) return 0;
    *(int32_t *)out = d;
    return 1;
}

/* device_traffic(device='cuda', reset=False) -> {'downloads', 'uploads', 'syncs', 'down_bytes', 'up_bytes'} */
static PyObject *mod_device_traffic(PyObject *m, PyObject *args, PyObject *kwargs) {
    static char *kw[] = {"device", "reset", NULL};
    int32_t d = KVC_DEVICE_CUDA;
    int reset = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O&p", kw, device_conv, &d, &reset)) return NULL;
    int64_t v[5];
    const kvc_status st = kvc_device_traffic(d, reset, v);
    if (st != KVC_OK) return kvc_py_raise(st);
    return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L}", "downloads", (long long)v[0], "uploads", (long long)v[1], "syncs",
                         (long long)v[2], "down_bytes", (long long)v[3], "up_bytes", (long long)v[4]);
}

static PyObject *mod_set_device_option(PyObject *m, PyObject *args) {
    const char *device, *name;
    int value;
    if (!PyArg_ParseTuple(args, "ssi", &device, &name, &value)) return NULL;
    const int d = kvc_py_device(device);
    if (d < 0) return NULL;
    kvc_status st = kvc_device_set_option(d, name, value);
    if (st != KVC_OK) return kvc_py_raise(st);
    Py_RETURN_NONE;
}

PyMethodDef kvc_py_device_methods[] = {
    {"device_available", mod_device_available, METH_VARARGS,
     "device_available(device='cuda'): True when the device can run (CUDA: library built and a usable GPU)."},
    {"device_info", mod_device_info, METH_VARARGS,
     "device_info(device='cuda') -> {'device', 'gemm'}; RuntimeError with the reason when the device cannot run."},
    {"memory_stats", mod_memory_stats, METH_VARARGS,
     "memory_stats(device='cuda') -> bytes the device's backend holds (current, peak, weights, cache, activations)."},
    {"reset_peak", mod_reset_peak, METH_VARARGS, "reset_peak(device='cuda'): the peak counters start again from now."},
    {"device_traffic", (PyCFunction)(void (*)(void))mod_device_traffic, METH_VARARGS | METH_KEYWORDS,
     "device_traffic(device='cuda', reset=False) -> host-device traffic since the last reset: downloads, uploads, "
     "syncs (waits for the device), down_bytes, up_bytes; reset=True starts again after reading. NotImplementedError "
     "on the CPU."},
    {"set_device_option", mod_set_device_option, METH_VARARGS,
     "set_device_option(device, name, value): 'builtin_gemm' 0/1, 'attention_kernel' 0 (WMMA) / 1 (mma.sync) / 2 (cuDNN's "
     "SDPA: NotImplementedError with the reason where cuDNN cannot load); on the CPU 'weight_prefetch' bytes "
     "(0..65536, default 2048) of the next weights a decode tile of a q8_0 or KIVI cache fetches (0: none); "
     "on the emulated device 'fail_after' n fails its (n+1)-th operation once (tests)."},
    {NULL, NULL, 0, NULL}};
