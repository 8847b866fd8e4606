"""The native-weight GEMM and GEMV of the CPU backend (weights in their GGUF block format) against float64
NumPy references that decode the weights with gguf-py, on fresh random inputs: every type the CPU keeps
natively, odd shapes, one and two threads, each path (the engine's pick, the blocked GEMM that decodes in
its packing step, the vectorised GEMV, the plain-C integer GEMV). Q4_0, Q4_1 and Q8_0 run in the CPU
backend's interleaved layout (groups of 16 rows, the rest as in the file: the shapes mix both) and, path
4, in the file's layout (a matrix that is not packed).

Two references:
  - exact decode: A (float64) @ gguf-py's decoded W. The blocked GEMM and the decoding GEMV (Q2_K,
    Q3_K, Q5_K, F16, BF16) only round in fp32 accumulation: bound 1e-5 of the largest sum of |products| (or of |C|).
  - the integer scheme (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K in the GEMV): each activation row is quantised to
    32-value int8 blocks (d = max|x| / 127, q = round-half-even(x / d), as llama.cpp's q8_0), then the
    dot products are exact in float64 over the decoded values. The kernels match that to fp32
    accumulation (bound 1e-5 of the largest sum of |products|: one output may cancel to near 0). Against the exact decode, the quantisation of A
    moves each activation by at most d / 2, so |C - exact| <= sum_j |W[i, j]| d_j / 2 (checked).
"""
import ctypes as C

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

import capi
from gguf_writer import GGML, random_blocks

lib = capi.lib
INT8_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"]
DECODE_TYPES = ["F16", "BF16", "Q2_K", "Q3_K", "Q5_K"]
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
PATH_AUTO, PATH_PACKED, PATH_GEMV, PATH_GEMV_REF, PATH_GEMV_FILE = 0, 1, 2, 3, 4
PACKED_TYPES = ["Q4_0", "Q4_1", "Q8_0"]  # quant.h: kvc_cpu_wtype_packs


def rel(a, ref, terms=None):
    """max |a - ref| over the largest |ref|, or over the largest sum of |products| when given (a single
    output may cancel to near zero; fp32 accumulation error scales with the terms, not the result)."""
    ref = np.asarray(ref, dtype=np.float64)
    scale = np.abs(ref).max() if terms is None else max(np.abs(ref).max(), terms.max())
    return float(np.abs(np.asarray(a, np.float64) - ref).max() / max(scale, 1e-30))


def weights(rng, t, n, k):
    """n rows of k values of type t: quantised from Gaussian values where gguf-py can quantise, random
    blocks with sane scales (the tests' GGUF writer) for the K-quants; and gguf-py's decode of them."""
    qt = gguf.GGMLQuantizationType[t]
    if t in K_TYPES:
        _, be, bb = GGML[t]
        raw = np.frombuffer(random_blocks(rng, t, n * k // be, scale=0.02), np.uint8).reshape(n, k // be * bb)
    else:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1, qt)
        raw = raw.view(np.uint8).reshape(n, -1)
    raw = np.ascontiguousarray(raw)
    return raw, dequantize(raw, qt).astype(np.float64).reshape(n, k)


def q8_rows(a):
    """The activation quantisation the integer kernels use, in NumPy (fp32 arithmetic as the kernel)."""
    m, k = a.shape
    x = a.reshape(m, k // 32, 32).astype(np.float32)
    d = (np.abs(x).max(axis=2, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(x * inv)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(m, k)


def half_steps(a):
    """d / 2 of each activation's block (the largest move quantisation makes)."""
    m, k = a.shape
    d = np.abs(a.reshape(m, k // 32, 32).astype(np.float64)).max(axis=2, keepdims=True) / 127
    return np.broadcast_to(d / 2, (m, k // 32, 32)).reshape(m, k)


def run(t, a, raw, n, path):
    m, k = a.shape
    c = np.full((m, n), np.nan, np.float32)
    st = lib.kvc_kernel_matmul_native(GGML[t][0], np.ascontiguousarray(a, np.float32), raw.ctypes.data_as(C.c_void_p),
                                      c, m, n, k, path)
    assert st == capi.OK, capi.last_error()
    return c


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = lib.kvc_get_num_threads()
    lib.kvc_set_num_threads(request.param)
    yield request.param
    lib.kvc_set_num_threads(before)


SHAPES = [(1, 1, 256), (1, 37, 512), (3, 97, 768), (12, 5, 256), (13, 70, 512), (40, 33, 1280), (1, 48, 256), (2, 16, 512)]


@pytest.mark.parametrize("t", INT8_TYPES + DECODE_TYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_native_matmul_against_float64(rng, threads, t, m, n, k):
    raw, w = weights(rng, t, n, k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    exact = a.astype(np.float64) @ w.T
    terms = np.abs(a.astype(np.float64)) @ np.abs(w).T
    # the blocked GEMM decodes in its packing step: only fp32 accumulation differs
    assert rel(run(t, a, raw, n, PATH_PACKED), exact, terms) < 1e-5
    gemv, gemv_ref = run(t, a, raw, n, PATH_GEMV), run(t, a, raw, n, PATH_GEMV_REF)
    if t in INT8_TYPES:
        scheme = q8_rows(a) @ w.T
        assert rel(gemv, scheme, terms) < 1e-5, "vectorised integer GEMV vs the q8 scheme"
        assert rel(gemv_ref, scheme, terms) < 1e-5, "plain-C integer GEMV vs the q8 scheme"
        assert rel(run(t, a, raw, n, PATH_GEMV_FILE), scheme, terms) < 1e-5, "the GEMV on the file's layout"
        # quantising A moves each value by at most half a step (d / 2): |C - exact| <= sum |w| d / 2
        assert (np.abs(gemv - exact) <= 1.001 * (half_steps(a) @ np.abs(w).T) + 1e-5 * np.abs(exact).max()).all()
    else:
        assert rel(gemv, exact, terms) < 1e-5 and rel(gemv_ref, exact, terms) < 1e-5
    auto = run(t, a, raw, n, PATH_AUTO)
    assert np.array_equal(auto, gemv if m <= 12 else run(t, a, raw, n, PATH_PACKED))


def test_native_matmul_rows_in_flight_odd_blocks(rng):
    """An odd number of blocks per row (the two-block loop's tail) and a single block (32-value types;
    the K-quants' odd super-block counts, 3 and 5, are in SHAPES)."""
    for k in (32, 96, 160):
        for t in INT8_TYPES[:5]:
            raw, w = weights(rng, t, 9, k)
            a = rng.standard_normal((2, k)).astype(np.float32)
            assert rel(run(t, a, raw, 9, PATH_GEMV), q8_rows(a) @ w.T) < 1e-5


@pytest.mark.parametrize("t", PACKED_TYPES)
def test_native_packed_gemv_group_and_tail_rows(rng, threads, t):
    """Full groups of 16 rows (the interleaved kernel) next to tail rows (the row kernel) and many
    activation rows (groups take 16 at a time): each output row checked, so a row written to another
    row's slot cannot pass."""
    for n, m in ((16, 1), (17, 3), (47, 2), (64, 18)):
        raw, w = weights(rng, t, n, 160)
        a = rng.standard_normal((m, 160)).astype(np.float32)
        scheme, terms = q8_rows(a) @ w.T, np.abs(a.astype(np.float64)) @ np.abs(w).T
        for path in (PATH_GEMV, PATH_GEMV_REF, PATH_GEMV_FILE):
            got = run(t, a, raw, n, path)
            for j in range(n):
                assert rel(got[:, j], scheme[:, j], terms[:, j]) < 1e-5, (path, n, m, j)


def test_native_matmul_zero_activations(rng):
    """An all-zero activation block has d = 0: its products are 0, never NaN."""
    raw, w = weights(rng, "Q4_1", 8, 64)
    a = np.zeros((1, 64), np.float32)
    a[0, 32:] = rng.standard_normal(32)
    assert rel(run("Q4_1", a, raw, 8, PATH_GEMV), q8_rows(a) @ w.T) < 1e-5


def test_native_matmul_errors(rng):
    raw, _ = weights(rng, "Q8_0", 4, 64)
    a = np.ones((1, 64), np.float32)
    c = np.zeros((1, 4), np.float32)
    ptr = raw.ctypes.data_as(C.c_void_p)
    assert lib.kvc_kernel_matmul_native(GGML["IQ2_XXS"][0], a, ptr, c, 1, 4, 256, 0) == capi.ERR_UNSUPPORTED
    assert "not kept natively" in capi.last_error()
    assert lib.kvc_kernel_matmul_native(8, a, ptr, c, 1, 4, 48, 0) != capi.OK  # not whole blocks
    assert "blocks" in capi.last_error()
    assert lib.kvc_kernel_matmul_native(8, a, ptr, c, 1, 4, 64, 9) == capi.ERR_ARG
    assert "0..4" in capi.last_error()
    assert lib.kvc_kernel_matmul_native(8, a, None, c, 1, 4, 64, 0) == capi.ERR_ARG
