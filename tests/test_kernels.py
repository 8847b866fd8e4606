"""Every CPU kernel against a float64 NumPy reference on fresh random inputs, through the public C ABI
(ctypes on libkvpress_c.so, no Python module involved)."""
import ctypes as C

import numpy as np
import pytest

from capi import lib
from kvpress_c._paths import openblas_path

F32P = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
I64P = np.ctypeslib.ndpointer(np.int64, flags="C_CONTIGUOUS")
lib.kvc_kernel_matmul.argtypes = [F32P, F32P, F32P, C.c_int64, C.c_int64, C.c_int64]
lib.kvc_kernel_rmsnorm.argtypes = [F32P, F32P, F32P, C.c_int64, C.c_int64, C.c_float]
lib.kvc_kernel_rope.argtypes = [F32P, I64P, C.c_int64, C.c_int32, C.c_int32, F32P, C.c_int32]
lib.kvc_kernel_swiglu.argtypes = [F32P, F32P, F32P, C.c_int64, C.c_int64]
lib.kvc_kernel_attention.argtypes = [F32P, C.c_int64, C.c_int32, C.c_int32, C.c_int32, C.c_void_p, C.c_void_p, I64P,
                                     C.c_float, F32P]
lib.kvc_set_blas.argtypes = [C.c_char_p, C.c_char_p]
lib.kvc_blas_name.restype = C.c_char_p


def f32(x):
    return np.ascontiguousarray(x, dtype=np.float32)


def rel(a, ref):
    return float(np.abs(a.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


@pytest.fixture(params=["builtin", "openblas"])
def gemm_impl(request):
    """Run GEMM tests with the built-in kernel and with OpenBLAS; restore the default after."""
    before = lib.kvc_blas_name()
    if request.param == "builtin":
        assert lib.kvc_set_blas(None, None) == 0
    else:
        path = openblas_path()
        if path is None:
            pytest.skip("scipy-openblas32 is not installed")
        assert lib.kvc_set_blas(path.encode(), b"scipy_cblas_sgemm") == 0
    yield request.param
    if before == b"builtin":
        lib.kvc_set_blas(None, None)
    else:
        lib.kvc_set_blas(before, b"scipy_cblas_sgemm")


@pytest.mark.parametrize("m,n,k", [(1, 7, 3), (33, 65, 129), (1, 576, 576), (64, 192, 576), (300, 1536, 576), (17, 576, 1536)])
def test_matmul(rng, gemm_impl, m, n, k):
    a, b = rng.standard_normal((m, k)), rng.standard_normal((n, k))
    c = np.zeros((m, n), dtype=np.float32)
    assert lib.kvc_kernel_matmul(f32(a), f32(b), c, m, n, k) == 0
    assert rel(c, a @ b.T) < 2e-6 * np.sqrt(k)


def test_rmsnorm(rng):
    x, w = rng.standard_normal((13, 576)) * 3, rng.standard_normal(576)
    y = np.zeros_like(f32(x))
    assert lib.kvc_kernel_rmsnorm(f32(x), f32(w), y, 13, 576, 1e-5) == 0
    ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w
    assert rel(y, ref) < 1e-6


def rope_ref(x, pos, inv, pairing):
    n, heads, d = x.shape
    ang = pos[:, None].astype(np.float64) * inv[None, :].astype(np.float64)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.astype(np.float64).copy()
    if pairing == 0:
        a, b = x[..., : d // 2], x[..., d // 2:]
        out[..., : d // 2], out[..., d // 2:] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("pairing", [0, 1])
@pytest.mark.parametrize("d", [64, 128])
def test_rope(rng, pairing, d):
    n, heads = 11, 3
    x = rng.standard_normal((n, heads, d))
    pos = rng.integers(0, 100000, size=n).astype(np.int64)
    inv = f32(10000.0 ** (-np.arange(0, d, 2) / d))
    y = f32(x)
    assert lib.kvc_kernel_rope(y, pos, n, heads, d, inv, pairing) == 0
    assert np.abs(y - rope_ref(x, pos, inv, pairing)).max() < 1e-4 * np.abs(x).max()


def test_rope_pairings_are_a_permutation(rng):
    """HALF on x equals ADJACENT on x with each head's dimensions interleaved (what GGUF converters do)."""
    d = 64
    x = f32(rng.standard_normal((5, 2, d)))
    pos = np.arange(5, dtype=np.int64) * 37
    inv = f32(10000.0 ** (-np.arange(0, d, 2) / d))
    perm = np.stack([np.arange(d // 2), np.arange(d // 2) + d // 2], axis=1).reshape(-1)
    half, adj = x.copy(), np.ascontiguousarray(x[..., perm])
    lib.kvc_kernel_rope(half, pos, 5, 2, d, inv, 0)
    lib.kvc_kernel_rope(adj, pos, 5, 2, d, inv, 1)
    np.testing.assert_allclose(adj, half[..., perm], rtol=0, atol=1e-5)


def test_swiglu(rng):
    g, u = rng.standard_normal((7, 1536)) * 4, rng.standard_normal((7, 1536))
    out = np.zeros((7, 1536), dtype=np.float32)
    assert lib.kvc_kernel_swiglu(f32(g), f32(u), out, 7, 1536) == 0
    assert rel(out, g / (1 + np.exp(-g)) * u) < 1e-6


def attention_ref(q, ks, vs, past, g):
    n, H, d = q.shape
    out = np.zeros((n, H, d))
    for hq in range(H):
        h = hq // g
        K, V = ks[h].astype(np.float64), vs[h].astype(np.float64)
        s = q[:, hq].astype(np.float64) @ K.T / np.sqrt(d)
        vis = np.arange(K.shape[0])[None, :] < (past[h] + np.arange(n) + 1)[:, None]
        s = np.where(vis, s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        out[:, hq] = (p / p.sum(1, keepdims=True)) @ V
    return out


@pytest.mark.parametrize("n,H,Hkv,d", [(1, 9, 3, 64), (37, 4, 4, 64), (300, 8, 2, 128), (5, 12, 3, 128), (130, 3, 1, 64)])
def test_attention_ragged(rng, n, H, Hkv, d):
    past = rng.integers(0, 200, size=Hkv).astype(np.int64)
    ks = [f32(rng.standard_normal((past[h] + n, d))) for h in range(Hkv)]
    vs = [f32(rng.standard_normal((past[h] + n, d))) for h in range(Hkv)]
    q = f32(rng.standard_normal((n, H, d)))
    kp = (C.c_void_p * Hkv)(*[k.ctypes.data for k in ks])
    vp = (C.c_void_p * Hkv)(*[v.ctypes.data for v in vs])
    out = np.zeros((n, H, d), dtype=np.float32)
    assert lib.kvc_kernel_attention(q, n, H, Hkv, d, kp, vp, past, 1 / np.sqrt(d), out) == 0
    assert rel(out, attention_ref(q, ks, vs, past, H // Hkv)) < 1e-5


def test_kernel_argument_errors():
    x = np.zeros(8, dtype=np.float32)
    assert lib.kvc_kernel_matmul(x, x, x, 0, 1, 1) == 1
    assert b"positive" in lib.kvc_last_error()
    pos = np.zeros(1, dtype=np.int64)
    assert lib.kvc_kernel_rope(x, pos, 1, 1, 3, x, 0) == 1  # odd head_dim
    assert lib.kvc_kernel_rope(x, pos, 1, 1, 4, x, 7) == 1  # unknown pairing
    past = np.zeros(2, dtype=np.int64)
    ptrs = (C.c_void_p * 2)(x.ctypes.data, x.ctypes.data)
    assert lib.kvc_kernel_attention(x, 1, 3, 2, 4, ptrs, ptrs, past, 1.0, x) == 1  # 3 % 2 != 0
    assert b"multiple" in lib.kvc_last_error()
