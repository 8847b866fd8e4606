"""The CPU backend's kernels against float64 NumPy references written from the spec, on fresh random
inputs, through the public C ABI (ctypes on libkvpress_c.so, no Python module involved).

Tolerances: fp32 kernels against float64 references, error measured relative to the largest
magnitude of the reference (1e-5 unless a comment says why)."""
import ctypes as C
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import capi
from kvpress_c._paths import core_library_path, openblas_path

# KVC_KERNELS_LIB: another build of the core (e.g. without -march=native) under the same tests
LIB_PATH = os.environ.get("KVC_KERNELS_LIB") or core_library_path()
lib = capi.bind(C.CDLL(LIB_PATH)) if os.environ.get("KVC_KERNELS_LIB") else capi.lib
KVC_OK, KVC_ERR_ARG, KVC_ERR_IO = capi.OK, capi.ERR_ARG, capi.ERR_IO
HALF, ADJACENT = 0, 1
TOL = 1e-5


def f32(x):
    return np.ascontiguousarray(x, dtype=np.float32)


def rel(a, ref):
    """max |a - ref| / max |ref|"""
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.abs(np.asarray(a, dtype=np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def seed_of(rng):
    return rng.bit_generator.seed_seq.entropy


# ------------------------------------------------------------------------------------------------
# GEMM


def restore_blas(before):
    os.environ.pop("KVC_BLAS_MIN_M", None)
    if before == b"builtin":
        lib.kvc_set_blas(None, None)
    else:
        lib.kvc_set_blas(before, b"scipy_cblas_sgemm")


@pytest.fixture(params=["builtin", "openblas"])
def gemm_impl(request):
    """Run with the built-in GEMM and with OpenBLAS (scipy-openblas32) loaded and used for every m
    (KVC_BLAS_MIN_M=1: by default the dispatch may prefer the built-in kernel); restore after."""
    before = lib.kvc_blas_name()
    if request.param == "builtin":
        assert lib.kvc_set_blas(None, None) == KVC_OK
    else:
        path = openblas_path()
        if path is None:
            pytest.skip("scipy-openblas32 is not installed")
        os.environ["KVC_BLAS_MIN_M"] = "1"
        assert lib.kvc_set_blas(path.encode(), b"scipy_cblas_sgemm") == KVC_OK, lib.kvc_last_error()
        assert lib.kvc_blas_name() == path.encode()
    yield request.param
    restore_blas(before)


def run_matmul(a, b):
    m, k = a.shape
    n = b.shape[0]
    c = np.full((m, n), np.nan, dtype=np.float32)  # the kernel must overwrite, not accumulate
    assert lib.kvc_kernel_matmul(f32(a), f32(b), c, m, n, k) == KVC_OK, lib.kvc_last_error()
    return c


# odd sizes (edges of every tile), the skinny/blocked boundary (m 12/13), several k chunks, and the
# default model's shapes (hidden 576, kv 192, ffn 1536, vocab 49152)
GEMM_SHAPES = [(1, 7, 3), (2, 5, 17), (3, 33, 1), (33, 65, 129), (12, 100, 70), (13, 100, 70), (9, 31, 1100),
               (100, 77, 1100), (1, 576, 576), (4, 192, 576), (64, 192, 576), (300, 1536, 576), (17, 576, 1536),
               (512, 576, 576), (700, 70, 1030), (1, 49152, 576), (64, 2048, 576)]


@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
def test_matmul(rng, gemm_impl, m, n, k):
    a, b = rng.standard_normal((m, k)), rng.standard_normal((n, k))
    c = run_matmul(a, b)
    err = rel(c, a @ b.T)
    assert err < TOL, f"{gemm_impl} m={m} n={n} k={k}: rel err {err:.2e} (seed {seed_of(rng)})"


def test_matmul_large_prefill(rng, gemm_impl):
    """A prefill-sized GEMM (2048 tokens x ffn)."""
    m, n, k = 2048, 1536, 576
    a, b = rng.standard_normal((m, k)), rng.standard_normal((n, k))
    err = rel(run_matmul(a, b), a @ b.T)
    assert err < TOL, f"{gemm_impl}: rel err {err:.2e} (seed {seed_of(rng)})"


def test_matmul_unaligned_and_one_thread(rng):
    """Operands not 64-byte aligned (views one float into a buffer), and the single-thread path."""
    m, n, k = 37, 70, 203
    abuf = f32(rng.standard_normal(m * k + 1))
    bbuf = f32(rng.standard_normal(n * k + 1))
    cbuf = np.zeros(m * n + 1, dtype=np.float32)
    a, b, c = abuf[1:], bbuf[1:], cbuf[1:]
    ref = a.reshape(m, k).astype(np.float64) @ b.reshape(n, k).astype(np.float64).T
    before = lib.kvc_get_num_threads()
    try:
        for threads in (1, before):
            lib.kvc_set_num_threads(threads)
            assert lib.kvc_get_num_threads() == threads
            c[:] = np.nan
            assert lib.kvc_kernel_matmul(a, b, c, m, n, k) == KVC_OK
            assert rel(c.reshape(m, n), ref) < TOL, f"threads={threads} (seed {seed_of(rng)})"
    finally:
        lib.kvc_set_num_threads(before)


def test_blas_selection_errors(tmp_path):
    before = lib.kvc_blas_name()
    try:
        assert lib.kvc_set_blas(str(tmp_path / "nope.so").encode(), None) == KVC_ERR_IO
        assert b"cannot load" in lib.kvc_last_error()
        path = openblas_path()
        if path is not None:
            assert lib.kvc_set_blas(path.encode(), b"no_such_sgemm") == KVC_ERR_IO
            assert b"no_such_sgemm" in lib.kvc_last_error()
            assert lib.kvc_blas_name() == before  # a failed call changes nothing
        assert lib.kvc_set_blas(None, None) == KVC_OK
        assert lib.kvc_blas_name() == b"builtin"
    finally:
        restore_blas(before)


def test_blas_from_environment(tmp_path):
    """KVC_BLAS=path is honoured at first use (default symbol lookup), a bad one is ignored with a
    warning, and an explicit kvc_set_blas wins."""
    path = openblas_path()
    if path is None:
        pytest.skip("scipy-openblas32 is not installed")
    script = textwrap.dedent(f"""
        import ctypes as C, numpy as np, sys
        lib = C.CDLL({LIB_PATH!r})
        lib.kvc_blas_name.restype = C.c_char_p
        lib.kvc_kernel_matmul.argtypes = [C.c_void_p] * 3 + [C.c_int64] * 3
        a = np.ones((32, 8), np.float32); b = np.ones((16, 8), np.float32); c = np.zeros((32, 16), np.float32)
        assert lib.kvc_kernel_matmul(a.ctypes.data, b.ctypes.data, c.ctypes.data, 32, 16, 8) == 0
        assert (c == 8).all()
        print(lib.kvc_blas_name().decode())
        if sys.argv[1] == "explicit":
            lib.kvc_set_blas.argtypes = [C.c_char_p, C.c_char_p]
            assert lib.kvc_set_blas(None, None) == 0
            print(lib.kvc_blas_name().decode())
    """)
    env = dict(os.environ, KVC_BLAS=path)
    env.pop("KVC_BLAS_SYMBOL", None)
    out = subprocess.run([sys.executable, "-c", script, "plain"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [path]
    out = subprocess.run([sys.executable, "-c", script, "explicit"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [path, "builtin"]
    env["KVC_BLAS"] = str(tmp_path / "missing.so")
    out = subprocess.run([sys.executable, "-c", script, "plain"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["builtin"]
    assert "KVC_BLAS" in out.stderr


# ------------------------------------------------------------------------------------------------
# RMSNorm, SwiGLU


@pytest.mark.parametrize("rows,dim", [(1, 576), (13, 576), (64, 4096), (3, 7)])
def test_rmsnorm(rng, rows, dim):
    x, w = rng.standard_normal((rows, dim)) * 3, rng.standard_normal(dim)
    eps = 1e-5
    ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
    y = np.zeros((rows, dim), dtype=np.float32)
    assert lib.kvc_kernel_rmsnorm(f32(x), f32(w), y, rows, dim, eps) == KVC_OK
    assert rel(y, ref) < TOL, f"seed {seed_of(rng)}"
    xi = f32(x)  # in place: y aliases x
    assert lib.kvc_kernel_rmsnorm(xi, f32(w), xi, rows, dim, eps) == KVC_OK
    assert np.array_equal(xi, y)


@pytest.mark.parametrize("rows,dim", [(1, 1536), (7, 1536), (100, 1536), (2, 13)])
def test_swiglu(rng, rows, dim):
    g, u = rng.standard_normal((rows, dim)) * 4, rng.standard_normal((rows, dim))
    g.flat[:4] = [-100.0, 100.0, -30.0, 0.0]  # saturated exp on both sides
    ref = g / (1 + np.exp(-g)) * u
    out = np.zeros((rows, dim), dtype=np.float32)
    assert lib.kvc_kernel_swiglu(f32(g), f32(u), out, rows, dim) == KVC_OK
    assert rel(out, ref) < TOL, f"seed {seed_of(rng)}"
    # element-wise too: silu is smooth, fp32 gives ~1e-7 relative per element (plus an absolute floor)
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-6 * np.abs(ref).max())
    gi = f32(g)  # out aliases gate
    assert lib.kvc_kernel_swiglu(gi, f32(u), gi, rows, dim) == KVC_OK
    assert np.array_equal(gi, out)


# ------------------------------------------------------------------------------------------------
# RoPE


def rope_ref(x, pos, inv, pairing):
    """x [n, heads, d] in float64; angle = pos * inv_freq[i]; a' = a cos - b sin, b' = a sin + b cos."""
    d = x.shape[-1]
    ang = pos[:, None].astype(np.float64) * inv[None, :].astype(np.float64)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x = x.astype(np.float64)
    out = x.copy()
    if pairing == HALF:
        a, b = x[..., : d // 2], x[..., d // 2:]
        out[..., : d // 2], out[..., d // 2:] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("pairing", [HALF, ADJACENT])
@pytest.mark.parametrize("n,heads,d", [(11, 3, 64), (40, 9, 64), (5, 4, 128), (3, 1, 2)])
def test_rope(rng, pairing, n, heads, d):
    x = rng.standard_normal((n, heads, d))
    pos = rng.integers(0, 131072, size=n).astype(np.int64)
    pos[0] = 0
    inv = f32(500000.0 ** (-np.arange(0, d, 2) / d))
    y = f32(x)
    assert lib.kvc_kernel_rope(y, pos, n, heads, d, inv, pairing) == KVC_OK
    assert rel(y, rope_ref(x, pos, inv, pairing)) < TOL, f"seed {seed_of(rng)}"
    assert np.array_equal(y[0], f32(x[0]))  # position 0 is the identity


def test_rope_pairings_are_a_permutation(rng):
    """HALF on x equals ADJACENT on x with each head's dimensions interleaved (i, i + d/2) -> (2i, 2i+1),
    the permutation GGUF converters apply to the q/k weights."""
    n, heads, d = 6, 3, 64
    x = f32(rng.standard_normal((n, heads, d)))
    pos = rng.integers(0, 50000, size=n).astype(np.int64)
    inv = f32(10000.0 ** (-np.arange(0, d, 2) / d))
    perm = np.stack([np.arange(d // 2), np.arange(d // 2) + d // 2], axis=1).reshape(-1)
    half, adj = x.copy(), np.ascontiguousarray(x[..., perm])
    assert lib.kvc_kernel_rope(half, pos, n, heads, d, inv, HALF) == KVC_OK
    assert lib.kvc_kernel_rope(adj, pos, n, heads, d, inv, ADJACENT) == KVC_OK
    np.testing.assert_array_equal(adj, half[..., perm])  # same arithmetic on the same pairs: bit-equal


# ------------------------------------------------------------------------------------------------
# Attention


def attention_ref(q, ks, vs, past, scale, start=None, cap=0.0):
    """Dense masked softmax in float64: query i of head hq sees the first past[h] + i + 1 rows of
    KV head h = hq // (H // Hkv), from row start[i, h] on when start is given (a sliding window); with cap,
    the scaled scores s become cap tanh(s / cap) first (Gemma 2's soft-capping)."""
    n, H, d = q.shape
    g = H // len(ks)
    out = np.zeros((n, H, d))
    for hq in range(H):
        h = hq // g
        K, V = ks[h].astype(np.float64), vs[h].astype(np.float64)
        s = q[:, hq].astype(np.float64) @ K.T * scale
        if cap:
            s = cap * np.tanh(s / cap)
        visible = np.arange(K.shape[0])[None, :] < (past[h] + np.arange(n) + 1)[:, None]
        if start is not None:
            visible &= np.arange(K.shape[0])[None, :] >= start[:, h][:, None]
        s = np.where(visible, s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        out[:, hq] = (p / p.sum(1, keepdims=True)) @ V
    return out


def run_attention(rng, n, H, Hkv, d, past, q_scale=1.0):
    ks = [f32(rng.standard_normal((past[h] + n, d))) for h in range(Hkv)]
    vs = [f32(rng.standard_normal((past[h] + n, d))) for h in range(Hkv)]
    q = f32(rng.standard_normal((n, H, d)) * q_scale)
    kp = (C.c_void_p * Hkv)(*[k.ctypes.data for k in ks])
    vp = (C.c_void_p * Hkv)(*[v.ctypes.data for v in vs])
    out = np.full((n, H, d), np.nan, dtype=np.float32)
    scale = 1 / np.sqrt(d)
    st = lib.kvc_kernel_attention(q, n, H, Hkv, d, kp, vp, past, scale, out)
    assert st == KVC_OK, lib.kvc_last_error()
    return out, attention_ref(q, ks, vs, past, np.float32(scale))


# (n, H, Hkv, d): decode (n=1, n<=4), prefill with n below and above the key tile (128) and the query
# tile, GQA groups 1, 3, 4 (and 32: more query heads than rows per task), head_dim 64, 128, 80, 256
ATTN_CASES = [(1, 9, 3, 64), (1, 8, 2, 128), (3, 12, 3, 128), (4, 32, 1, 64), (5, 12, 3, 128), (37, 4, 4, 64),
              (130, 9, 3, 64), (200, 8, 2, 128), (70, 32, 1, 128), (65, 6, 3, 80), (20, 2, 1, 256)]


@pytest.mark.parametrize("n,H,Hkv,d", ATTN_CASES)
def test_attention_ragged(rng, n, H, Hkv, d):
    past = rng.integers(0, 300, size=Hkv).astype(np.int64)
    past[0] = 0  # one head with no past at all
    out, ref = run_attention(rng, n, H, Hkv, d, past)
    err = rel(out, ref)
    assert err < TOL, f"n={n} H={H} Hkv={Hkv} d={d} past={past}: rel err {err:.2e} (seed {seed_of(rng)})"


@pytest.mark.parametrize("n,H,Hkv,d", [(1, 9, 3, 64), (2, 32, 8, 128), (1, 4, 1, 64), (1, 10, 2, 80), (2, 6, 2, 256),
                                        (1, 6, 2, 36)])
def test_attention_decode_long(rng, n, H, Hkv, d):
    """Decode over long, very unequal pasts (the key range of a head is split across threads); the
    P V update takes 4 rows x 4 vectors of columns at a time: 5 and 6 rows, head_dim 80 (a masked tail), 256,
    and 36 (the scores' dot products end in a part vector, on AVX2 as on AVX-512)."""
    past = np.array([[3000, 17, 1200, 640][h % 4] for h in range(Hkv)], dtype=np.int64)
    out, ref = run_attention(rng, n, H, Hkv, d, past)
    err = rel(out, ref)
    assert err < TOL, f"past={past}: rel err {err:.2e} (seed {seed_of(rng)})"


@pytest.mark.parametrize("n", [1, 100])
def test_attention_peaky(rng, n):
    """Large scores (a nearly one-hot softmax, the running max changing from tile to tile)."""
    past = np.array([150, 400], dtype=np.int64)
    out, ref = run_attention(rng, n, 6, 2, 64, past, q_scale=12.0)
    err = rel(out, ref)
    # scores reach ~50 here, and their fp32 rounding error (~1e-6 absolute, vs 1e-7 for unit scores)
    # shifts the softmax weights by as much: 3e-5 (6e-6 seen at most over 40 seeds)
    assert err < 3e-5, f"rel err {err:.2e} (seed {seed_of(rng)})"


def test_attention_first_query_sees_only_first_key(rng):
    """past 0, query 0: the output is exactly v[0] (the weight of the only visible key is 1)."""
    out, ref = run_attention(rng, 3, 2, 1, 64, np.zeros(1, dtype=np.int64))
    assert rel(out, ref) < TOL
    np.testing.assert_allclose(out[0], ref[0], rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Argument validation


def test_kernel_argument_errors():
    x = np.zeros(64, dtype=np.float32)
    pos = np.zeros(2, dtype=np.int64)

    def err(status, *words):
        assert status == KVC_ERR_ARG
        msg = lib.kvc_last_error()
        for w in words:
            assert w.encode() in msg, msg

    null = None
    saved = lib.kvc_kernel_matmul.argtypes
    lib.kvc_kernel_matmul.argtypes = [C.c_void_p] * 3 + [C.c_int64] * 3
    try:
        err(lib.kvc_kernel_matmul(null, x.ctypes.data, x.ctypes.data, 1, 1, 1), "matmul", "NULL")
    finally:
        lib.kvc_kernel_matmul.argtypes = saved
    err(lib.kvc_kernel_matmul(x, x, x, 0, 1, 1), "matmul", "positive", "m=0")
    err(lib.kvc_kernel_matmul(x, x, x, 1, -2, 1), "positive", "n=-2")
    err(lib.kvc_kernel_rmsnorm(x, x, x, 1, 0, 1e-5), "rmsnorm", "positive")
    err(lib.kvc_kernel_rmsnorm(x, x, x, 1, 4, 0.0), "rmsnorm", "eps")
    err(lib.kvc_kernel_rope(x, pos, 1, 1, 3, x, HALF), "rope", "even", "3")
    err(lib.kvc_kernel_rope(x, pos, 1, 1, 4, x, 7), "rope", "pairing", "7")
    err(lib.kvc_kernel_rope(x, pos, 0, 1, 4, x, HALF), "rope", "positive")
    err(lib.kvc_kernel_rope(x, np.array([3, -1], dtype=np.int64), 2, 1, 4, x, HALF), "rope", "negative")
    err(lib.kvc_kernel_swiglu(x, x, x, 0, 4), "swiglu", "positive")
    ptrs = (C.c_void_p * 2)(x.ctypes.data, x.ctypes.data)
    past = np.zeros(2, dtype=np.int64)
    err(lib.kvc_kernel_attention(x, 1, 3, 2, 4, ptrs, ptrs, past, 1.0, x), "attention", "multiple")
    err(lib.kvc_kernel_attention(x, 0, 2, 2, 4, ptrs, ptrs, past, 1.0, x), "attention", "positive")
    err(lib.kvc_kernel_attention(x, 1, 2, 2, 512, ptrs, ptrs, past, 1.0, x), "attention", "256")
    err(lib.kvc_kernel_attention(x, 1, 2, 2, 4, ptrs, ptrs, np.array([0, -5], dtype=np.int64), 1.0, x),
        "attention", "past_len[1]", "negative")
    err(lib.kvc_kernel_attention(x, 1, 2, 2, 4, (C.c_void_p * 2)(x.ctypes.data, None), ptrs, past, 1.0, x),
        "attention", "k[1]")
    err(lib.kvc_kernel_attention(x, 1, 2, 2, 4, None, ptrs, past, 1.0, x), "attention", "NULL")


# ---- sliding window and Qwen3's per-head norm (CPU kernels through the device entry points, device 0) ----

@pytest.mark.parametrize("n,H,Hkv,d", [(1, 8, 2, 64), (3, 12, 3, 128), (37, 4, 4, 64), (130, 9, 3, 64), (200, 8, 2, 128)])
def test_attention_window_starts(rng, n, H, Hkv, d):
    """Per-(query, head) first visible rows, as the engine computes them for a window over a cache whose
    rows are not consecutive positions: nondecreasing in the query, anywhere up to the query's own row."""
    past = rng.integers(0, 300, size=Hkv).astype(np.int64)
    start = np.zeros((n, Hkv), np.int64)
    for h in range(Hkv):  # a running max of draws in [0, past + i]: nondecreasing, never past row past + i
        start[:, h] = np.maximum.accumulate(rng.integers(0, past[h] + np.arange(n) + 1))
    ks = [f32(rng.standard_normal((past[h] + n, d))) for h in range(Hkv)]
    vs = [f32(rng.standard_normal((past[h] + n, d))) for h in range(Hkv)]
    q = f32(rng.standard_normal((n, H, d)))
    kp = (C.c_void_p * Hkv)(*[k.ctypes.data for k in ks])
    vp = (C.c_void_p * Hkv)(*[v.ctypes.data for v in vs])
    out = np.full((n, H, d), np.nan, dtype=np.float32)
    scale = 1 / np.sqrt(d)
    st = lib.kvc_device_kernel_attention(0, q, n, H, Hkv, d, C.cast(kp, C.c_void_p), C.cast(vp, C.c_void_p), past,
                                         start.ctypes.data, scale, out, 0)
    assert st == KVC_OK, lib.kvc_last_error()
    err = rel(out, attention_ref(q, ks, vs, past, np.float32(scale), start))
    assert err < TOL, f"n={n} H={H} Hkv={Hkv} d={d}: rel err {err:.2e} (seed {seed_of(rng)})"


@pytest.mark.parametrize("n,H,Hkv,d,window", [(1, 8, 2, 64, False), (3, 12, 3, 128, True), (37, 4, 4, 64, False),
                                                (130, 9, 3, 64, True), (65, 6, 3, 80, False)])
def test_attention_softcap(rng, n, H, Hkv, d, window):
    """Soft-capped scores (cap tanh(s / cap) before the softmax) on the decode (n <= 4) and prefill paths, with and
    without a sliding window, against the float64 reference; queries scaled so the scores reach well past the cap."""
    past = rng.integers(0, 300, size=Hkv).astype(np.int64)
    start = None
    if window:
        start = np.stack([np.maximum.accumulate(rng.integers(0, p + np.arange(n) + 1)) for p in past], 1).astype(np.int64)
    ks = [f32(rng.standard_normal((past[h] + n, d))) for h in range(Hkv)]
    vs = [f32(rng.standard_normal((past[h] + n, d))) for h in range(Hkv)]
    q = f32(rng.standard_normal((n, H, d)) * 4)  # scaled scores ~ N(0, 16): many beyond the cap
    kp = (C.c_void_p * Hkv)(*[k.ctypes.data for k in ks])
    vp = (C.c_void_p * Hkv)(*[v.ctypes.data for v in vs])
    scale, cap = np.float32(1 / np.sqrt(d)), np.float32(5.0)
    out = np.full((n, H, d), np.nan, dtype=np.float32)
    st = lib.kvc_device_kernel_attention_softcap(0, q, n, H, Hkv, d, C.cast(kp, C.c_void_p), C.cast(vp, C.c_void_p), past,
                                                 None if start is None else start.ctypes.data, scale, cap, out, 0)
    assert st == KVC_OK, lib.kvc_last_error()
    ref = attention_ref(q, ks, vs, past, scale, start, cap=float(cap))
    err, moved = rel(out, ref), rel(attention_ref(q, ks, vs, past, scale, start), ref)
    assert moved > 0.1, f"the cap should change the output (moved {moved:.3f})"
    assert err < TOL, f"n={n} H={H} Hkv={Hkv} d={d}: rel err {err:.2e}, the cap moves it {moved:.3f} (seed {seed_of(rng)})"
    bad = lib.kvc_device_kernel_attention_softcap(0, q, n, H, Hkv, d, C.cast(kp, C.c_void_p), C.cast(vp, C.c_void_p), past,
                                                  None, scale, np.float32(-1), out, 0)
    assert bad != KVC_OK and "softcap" in lib.kvc_last_error().decode()


def test_attention_window_start_out_of_order_is_refused(rng):
    q = f32(rng.standard_normal((2, 2, 16)))
    k = f32(rng.standard_normal((12, 16)))
    kp = (C.c_void_p * 1)(k.ctypes.data)
    out = np.zeros((2, 2, 16), np.float32)
    past = np.array([10], np.int64)
    for start in ([[5], [4]], [[11], [11]], [[-1], [0]]):  # moves back; past the query's own row; negative
        st = lib.kvc_device_kernel_attention(0, q, 2, 2, 1, 16, C.cast(kp, C.c_void_p), C.cast(kp, C.c_void_p), past,
                                             np.array(start, np.int64).ctypes.data, 0.25, out, 0)
        assert st != KVC_OK and "window start" in lib.kvc_last_error().decode()


@pytest.mark.parametrize("n,heads,d", [(1, 16, 128), (37, 8, 64), (300, 2, 16)])
def test_head_rmsnorm(rng, n, heads, d):
    x = f32(rng.standard_normal((n, heads, d)) * 3)
    w = f32(1 + 0.1 * rng.standard_normal(d))
    ours = x.copy()
    assert lib.kvc_device_kernel_head_rmsnorm(0, ours, n, heads, d, w, np.float32(1e-6)) == KVC_OK, lib.kvc_last_error()
    xd = x.astype(np.float64)
    ref = xd / np.sqrt((xd ** 2).mean(-1, keepdims=True) + 1e-6) * w
    assert rel(ours, ref) < 1e-6, f"seed {seed_of(rng)}"  # fp32 output of a double sum: a few ulp
