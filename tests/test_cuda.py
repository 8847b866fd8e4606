"""The CUDA backend against the CPU backend (the reference), and its behaviour without a GPU.

Every GPU test is skipped with the reason when kvpress_c.cuda_available() is False (library not
built, or no usable GPU). Inputs are fresh random draws each run (seed printed on failure). The GPU
computes in bf16 with fp32 accumulation, so the CPU reference runs on the same bf16-rounded inputs
and the tolerances are those of one or a few bf16 roundings (2^-8 relative each) on the outputs.
The tests named llama8b write a 16 GB Llama-3.1-8B-shaped model in the temp folder and take minutes
(`-k "not llama8b"` leaves them out).
"""
from __future__ import annotations

import ctypes as C
import os

import numpy as np
import pytest

import kvpress_c
from capi import CError, F32P, I64P, PressConfig, lib, press_compute, press_config
from random_llama import LLAMA31_8B, llama31_8b_dir, write_llama31_bf16, write_random_llama



def _why_no_cuda() -> str:
    try:
        kvpress_c._core.cuda_init()
        return ""
    except RuntimeError as e:
        return str(e)


HAS_CUDA = kvpress_c.cuda_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason=_why_no_cuda() or "no CUDA backend")

KVC_ERR_DEVICE = 6
BF16_EPS = 2.0 ** -8

# ---- ctypes bindings of the kvc_cuda_* entry points (csrc/include/kvpress_c.h) ----
lib.kvc_cuda_available.restype = C.c_int
lib.kvc_cuda_kernel_matmul.argtypes = [F32P, F32P, F32P, C.c_int64, C.c_int64, C.c_int64]
lib.kvc_cuda_kernel_rmsnorm.argtypes = [F32P, C.c_void_p, F32P, F32P, C.c_void_p, C.c_int64, C.c_int64, C.c_float]
lib.kvc_cuda_kernel_rope.argtypes = [F32P, I64P, C.c_int64, C.c_int32, C.c_int32, F32P, C.c_int32]
lib.kvc_cuda_kernel_swiglu.argtypes = [F32P, F32P, F32P, C.c_int64, C.c_int64]
lib.kvc_cuda_kernel_attention.argtypes = [F32P, C.c_int64, C.c_int32, C.c_int32, C.c_int32, C.c_void_p, C.c_void_p,
                                          I64P, C.c_float, F32P, C.c_int32]
lib.kvc_cuda_kernel_topk.argtypes = [F32P, C.c_int32, C.c_int64, I64P, I64P]
lib.kvc_cuda_press_compute_ex.argtypes = [C.POINTER(PressConfig), C.c_int32, C.c_int32, C.c_int32, C.c_int32,
                                          C.c_int32, F32P, C.c_void_p, C.c_int64, F32P, F32P, C.c_int64, C.c_int64, F32P,
                                          I64P, I64P]
lib.kvc_cuda_force_builtin_gemm.argtypes = [C.c_int]
lib.kvc_cuda_set_attention_kernel.argtypes = [C.c_int]
lib.kvc_kernel_matmul.argtypes = [F32P, F32P, F32P, C.c_int64, C.c_int64, C.c_int64]
lib.kvc_kernel_rmsnorm.argtypes = [F32P, F32P, F32P, C.c_int64, C.c_int64, C.c_float]
lib.kvc_kernel_rope.argtypes = [F32P, I64P, C.c_int64, C.c_int32, C.c_int32, F32P, C.c_int32]
lib.kvc_kernel_swiglu.argtypes = [F32P, F32P, F32P, C.c_int64, C.c_int64]
lib.kvc_kernel_attention.argtypes = [F32P, C.c_int64, C.c_int32, C.c_int32, C.c_int32, C.c_void_p, C.c_void_p, I64P,
                                     C.c_float, F32P]


def check(st):
    if st != 0:
        raise CError(st)


def bf16(x):
    """Round to the nearest bf16 (ties to even), returned as float32: what the GPU computes on."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).reshape(x.shape)


def rel(a, ref):
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(np.asarray(a, np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))


# ---------------------------------------------------------------------------------------------- #
# without a GPU: a clear error, never a crash                                                      #
# ---------------------------------------------------------------------------------------------- #

@pytest.mark.skipif(HAS_CUDA, reason="a GPU is available: the no-GPU behaviour cannot be observed")
def test_without_gpu_cuda_is_unavailable_with_a_clear_error(tmp_path):
    assert kvpress_c.cuda_available() is False
    assert lib.kvc_cuda_available() == 0
    path = write_random_llama(str(tmp_path / "m"), layers=1, hidden=64, heads=2, kv_heads=1, ffn=64, vocab=64)
    with pytest.raises(RuntimeError, match=r"CUDA backend not available: .+; use device='cpu'"):
        kvpress_c.load_model(path, device="cuda")
    with pytest.raises(RuntimeError, match="CUDA backend not available"):
        kvpress_c._core.cuda_init()
    with pytest.raises(ValueError, match="device must be"):
        kvpress_c.load_model(path, device="tpu")
    # the C entry points fail with a status and a message, nothing aborts
    a = np.ones((2, 2), np.float32)
    st = lib.kvc_cuda_kernel_matmul(a, a, np.zeros((2, 2), np.float32), 2, 2, 2)
    assert st == KVC_ERR_DEVICE and b"CUDA backend not available" in lib.kvc_last_error()
    q, kv = np.ones((20, 4, 16), np.float32), np.ones((2, 20, 16), np.float32)
    with pytest.raises(CError, match="CUDA backend not available"):
        cuda_press_compute(press_config(scorer=6, compression_ratio=0.5, window=4), q, kv, kv, attn=q)
    # and the CPU path is untouched
    m = kvpress_c.load_model(path)
    assert m.device == "cpu" and m._core.device == "cpu"
    assert np.isfinite(m.logits([1, 2, 3])).all()


# ---------------------------------------------------------------------------------------------- #
# kernels against the CPU backend                                                                  #
# ---------------------------------------------------------------------------------------------- #

def _switch_fixture(name, setter, ids):
    """A fixture `name` over the two settings 0 and 1 of a global switch of the CUDA backend
    (setter(int) -> status): each test runs with both, and the switch is back at 0 afterwards."""
    @pytest.fixture(params=[0, 1], ids=ids, name=name)
    def switch(request):
        if HAS_CUDA:
            check(setter(request.param))
        yield request.param
        if HAS_CUDA:
            check(setter(0))
    return switch


gemm_mode = _switch_fixture("gemm_mode", lib.kvc_cuda_force_builtin_gemm, ["cublas-or-default", "builtin-wmma"])


@needs_gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (7, 33, 65), (300, 1000, 256), (2048, 512, 1024)])
def test_matmul(rng, gemm_mode, m, n, k):
    a, b = bf16(rng.standard_normal((m, k))), bf16(rng.standard_normal((n, k)))
    c = np.zeros((m, n), np.float32)
    check(lib.kvc_cuda_kernel_matmul(a, b, c, m, n, k))
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    assert rel(c, ref) < 1e-4  # exact bf16 products, fp32 sums


@needs_gpu
@pytest.mark.parametrize("rows,dim", [(1, 4096), (37, 576), (300, 128)])
def test_rmsnorm_with_residual(rng, rows, dim):
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    r = bf16(rng.standard_normal((rows, dim)))
    w = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    y, x_out = np.zeros_like(x), np.zeros_like(x)
    check(lib.kvc_cuda_kernel_rmsnorm(x, r.ctypes.data, w, y, x_out.ctypes.data, rows, dim, 1e-5))
    xs = (x + r).astype(np.float32)
    ref = np.zeros_like(x)
    check(lib.kvc_kernel_rmsnorm(xs, w, ref, rows, dim, 1e-5))
    assert rel(x_out, xs) < 1e-6
    assert rel(y, ref) < 2 * BF16_EPS  # one rounding of the output


@needs_gpu
@pytest.mark.parametrize("pairing", [0, 1])
@pytest.mark.parametrize("n,heads,d", [(5, 4, 64), (64, 8, 128), (3, 2, 16)])
def test_rope(rng, pairing, n, heads, d):
    x = bf16(rng.standard_normal((n, heads, d)))
    pos = np.sort(rng.integers(0, 131072, size=n)).astype(np.int64)
    inv = (500000.0 ** (-np.arange(0, d, 2) / d)).astype(np.float32)
    ours, ref = x.copy(), x.copy()
    check(lib.kvc_cuda_kernel_rope(ours, pos, n, heads, d, inv, pairing))
    check(lib.kvc_kernel_rope(ref, pos, n, heads, d, inv, pairing))
    assert rel(ours, ref) < 2 * BF16_EPS


@needs_gpu
@pytest.mark.parametrize("rows,dim", [(1, 14336), (33, 1536)])
def test_swiglu(rng, rows, dim):
    g, u = bf16(rng.standard_normal((rows, dim)) * 3), bf16(rng.standard_normal((rows, dim)))
    ours, ref = np.zeros_like(g), np.zeros_like(g)
    check(lib.kvc_cuda_kernel_swiglu(g, u, ours, rows, dim))
    check(lib.kvc_kernel_swiglu(g, u, ref, rows, dim))
    assert rel(ours, ref) < 2 * BF16_EPS


attention_kernel = _switch_fixture("attention_kernel", lib.kvc_cuda_set_attention_kernel,
                                   ["wmma-attention", "mma-attention"])


def run_attention(fn, q, ks, vs, past, scale, *extra):
    n, H, d = q.shape
    Hkv = len(ks)
    kp = (C.c_void_p * Hkv)(*[k.ctypes.data for k in ks])
    vp = (C.c_void_p * Hkv)(*[v.ctypes.data for v in vs])
    out = np.zeros((n, H, d), np.float32)
    check(fn(q, n, H, Hkv, d, C.cast(kp, C.c_void_p), C.cast(vp, C.c_void_p), past, scale, out, *extra))
    return out


@needs_gpu
@pytest.mark.parametrize("n,H,Hkv,d", [(1, 32, 8, 128), (1, 9, 3, 64), (100, 8, 2, 128), (257, 4, 4, 64),
                                       (70, 6, 2, 32), (1, 4, 1, 16)])
@pytest.mark.parametrize("force_prefill", [0, 1])
def test_attention_ragged(rng, attention_kernel, n, H, Hkv, d, force_prefill):
    past = rng.integers(0, 3000, size=Hkv).astype(np.int64)
    past[0] = 0  # a head with no past: the first query sees only itself
    q = bf16(rng.standard_normal((n, H, d)) * 2)
    ks = [bf16(rng.standard_normal((int(p) + n, d))) for p in past]
    vs = [bf16(rng.standard_normal((int(p) + n, d))) for p in past]
    scale = 1 / np.sqrt(d)
    ours = run_attention(lib.kvc_cuda_kernel_attention, q, ks, vs, past, scale, force_prefill)
    ref = run_attention(lib.kvc_kernel_attention, q, ks, vs, past, scale)
    # probabilities rounded to bf16 before P V (flash) or fp32 throughout (decode); output rounded once
    assert rel(ours, ref) < 1.5e-2


@needs_gpu
def test_attention_long_decode_split_k(rng):
    H, Hkv, d, n = 32, 8, 128, 1
    past = np.array([100000, 5, 65000, 1, 0, 7777, 12345, 31], np.int64)
    q = bf16(rng.standard_normal((n, H, d)) * 3)
    ks = [bf16(rng.standard_normal((int(p) + n, d))) for p in past]
    vs = [bf16(rng.standard_normal((int(p) + n, d))) for p in past]
    ours = run_attention(lib.kvc_cuda_kernel_attention, q, ks, vs, past, 1 / np.sqrt(d), 0)
    ref = run_attention(lib.kvc_kernel_attention, q, ks, vs, past, 1 / np.sqrt(d))
    assert rel(ours, ref) < 1e-2


def topk_ref(s, k):
    order = sorted(range(len(s)), key=lambda r: (-(s[r] if not np.isnan(s[r]) else -np.inf), r))
    return np.sort(np.array(order[:k], np.int64))


@needs_gpu
@pytest.mark.parametrize("n", [1, 17, 1000, 131072])
def test_topk_with_ties_and_nan(rng, n):
    heads = 3
    s = rng.integers(0, 20, size=(heads, n)).astype(np.float32)  # many ties: lower row wins
    s[0, : n // 3] = np.nan
    s[1, ::2] = -0.0
    s[1, 1::2] = 0.0
    k = np.array([n // 2, max(n - 1, 1), 1], np.int64)
    keep = np.full((heads, n), -1, np.int64)
    check(lib.kvc_cuda_kernel_topk(s, heads, n, k, keep))
    for h in range(heads):
        kk = min(int(k[h]), n)
        if n <= 1000:
            np.testing.assert_array_equal(keep[h, :kk], topk_ref(s[h], kk))
        else:
            key = np.where(np.isnan(s[h]), -np.inf, s[h]).astype(np.float64)
            ref = np.sort(np.lexsort((np.arange(n), -key))[:kk])
            np.testing.assert_array_equal(keep[h, :kk], ref)


def cuda_press_compute(cfg, q, k, v, layer=0, n_layers=1, attn=None):
    """capi.press_compute with the scores computed on the GPU (kvc_cuda_press_compute_ex)."""
    n, H, d = q.shape
    Hkv, length, _ = k.shape
    scores = np.zeros((Hkv, length), np.float32)
    keep = np.zeros((Hkv, length), np.int64)
    n_keep = np.zeros(Hkv, np.int64)
    a = None if attn is None else np.ascontiguousarray(attn, dtype=np.float32)
    check(lib.kvc_cuda_press_compute_ex(C.byref(cfg), H, Hkv, d, layer, n_layers, np.ascontiguousarray(q),
                                        None if a is None else a.ctypes.data, n, np.ascontiguousarray(k),
                                        np.ascontiguousarray(v), length, -1, scores, keep, n_keep))
    return scores, [keep[h, :n_keep[h]].copy() for h in range(Hkv)]


def jaccard(a, b):
    a, b = set(a.tolist()), set(b.tolist())
    return len(a & b) / max(len(a | b), 1)


PRESSES = {
    "snapkv": dict(scorer=5, compression_ratio=0.5, window=16),
    "snapkv-max-reduce-first": dict(scorer=5, compression_ratio=0.7, window=8, pool_max=1, gqa_max=1, pool_then_reduce=0),
    "pyramidkv": dict(scorer=5, allocation=1, budget=96, window=16),
    "adakv": dict(scorer=5, allocation=2, compression_ratio=0.5, window=16),
    "chunkkv": dict(scorer=5, compression_ratio=0.5, window=16, chunk_length=10),
    "tova": dict(scorer=3, compression_ratio=0.5, window=0),
    "knorm": dict(scorer=1, compression_ratio=0.5, window=0),
    "streaming": dict(scorer=0, compression_ratio=0.5, window=0),
    "random": dict(scorer=2, compression_ratio=0.5, window=0, seed=7),
    "edie": dict(scorer=6, compression_ratio=0.5, window=16),
    "edie-wide-window": dict(scorer=6, compression_ratio=0.3, window=120, kernel=5, edie_alpha=0.3),
    "edie-no-mid-range": dict(scorer=6, compression_ratio=0.5, window=170),  # (w, len - 2w] empty: every past row
    "edie-long-cache": dict(scorer=6, compression_ratio=0.5, window=32),  # 2,500 rows: the kernel's 1,024-row chunks
}


def edie_inputs(rng, q, k, v, w):
    """EDIE's attention outputs, and K/V reshaped so that each of its terms shows in the scores: |v_r|_1
    and |o_j|_1 vary by row and head, and row 0, outside the mid range, draws each group's window
    queries. Measured with a NumPy EDIE on 10 draws of these shapes: o_j from the wrong row or head,
    or |k| for |v|, moves the scores by 6 % or more (3x the tolerance), c_j over every past row
    instead of the mid range by a factor of 6 or more."""
    n, H, d = q.shape
    Hkv, g = k.shape[0], H // k.shape[0]
    attn = rng.standard_normal((n, H, d)) * np.exp(1.5 * rng.standard_normal((n, H, 1)))
    v = v * np.exp(rng.standard_normal((Hkv, v.shape[1], 1)))
    k = k.copy()
    for h in range(Hkv):
        m = q[n - w:, h * g:(h + 1) * g].mean((0, 1))
        k[h, 0] = 2.0 * np.sqrt(d) * m / np.linalg.norm(m)
    return bf16(attn), k, v


@needs_gpu
@pytest.mark.parametrize("name", sorted(PRESSES))
def test_press_scores_and_kept_rows_match_cpu(rng, name):
    n, H, Hkv, d, past = 300, 8, 2, 64, (2200 if name == "edie-long-cache" else 200)
    length = past + n
    q = bf16(rng.standard_normal((n, H, d)) * 2)
    k = rng.standard_normal((Hkv, length, d))
    v = rng.standard_normal((Hkv, length, d))
    attn = None
    if name.startswith("edie"):  # EDIE also reads the queries' attention outputs
        attn, k, v = edie_inputs(rng, q, k, v, PRESSES[name]["window"])
    k, v = bf16(k), bf16(v)
    cfg = press_config(**PRESSES[name])
    s_gpu, keep_gpu = cuda_press_compute(cfg, q, k, v, layer=1, n_layers=4, attn=attn)
    s_cpu, keep_cpu = press_compute(press_config(**PRESSES[name]), q, k, v, layer=1, n_layers=4, attn=attn)
    assert rel(s_gpu, s_cpu) < 2e-2
    if name == "adakv":  # head budgets follow the scores: compare the layer's whole selection
        flat = lambda keep: np.concatenate([h * length + k for h, k in enumerate(keep)])
        assert sum(map(len, keep_gpu)) == sum(map(len, keep_cpu))
        assert jaccard(flat(keep_gpu), flat(keep_cpu)) > 0.85
        return
    for h in range(Hkv):
        assert len(keep_gpu[h]) == len(keep_cpu[h])
        if name in ("streaming", "random"):
            np.testing.assert_array_equal(keep_gpu[h], keep_cpu[h])
        else:  # bf16 scores may swap near-ties at the cut (ChunkKV swaps 10 rows at a time)
            assert jaccard(keep_gpu[h], keep_cpu[h]) > (0.8 if name == "chunkkv" else 0.9), name


@needs_gpu
def test_press_unsupported_scorer_is_a_clear_error(rng):
    q = rng.standard_normal((20, 4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 20, 16)).astype(np.float32)
    with pytest.raises(CError, match="no CUDA implementation"):
        cuda_press_compute(press_config(scorer=4, compression_ratio=0.5, window=0), q, k, k)
    with pytest.raises(CError, match="EDIE needs the attention outputs"):
        cuda_press_compute(press_config(scorer=6, compression_ratio=0.5, window=4), q, k, k)


# ---------------------------------------------------------------------------------------------- #
# a whole model                                                                                    #
# ---------------------------------------------------------------------------------------------- #

SHAPES = {"hd64": dict(layers=3, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=512),
          "hd128": dict(layers=2, hidden=1024, heads=8, kv_heads=2, ffn=1024, vocab=1000),
          "hd32-generic": dict(layers=2, hidden=128, heads=4, kv_heads=4, ffn=256, vocab=300)}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model_pair(request, tmp_path_factory):
    if not HAS_CUDA:
        pytest.skip(_why_no_cuda())
    path = write_random_llama(str(tmp_path_factory.mktemp(request.param)), **SHAPES[request.param])
    return path, kvpress_c.load_model(path), kvpress_c.load_model(path, device="cuda")


@needs_gpu
def test_logits_prefill_and_decode_match_cpu(model_pair, rng):
    path, cpu, gpu = model_pair
    assert gpu.device == "cuda" and gpu._core.device == "cuda"
    V = cpu.config["vocab"]
    ids = rng.integers(3, V, size=333).astype(np.int32)
    ref = cpu.logits(ids)
    ours = gpu.logits(ids)
    assert rel(ours, ref) < 3e-2
    # decode steps on the device cache (split-K attention) against the CPU
    sc, sg = cpu.new_session(), gpu.new_session()
    sc.forward(ids[:300], logits="none")
    sg.forward(ids[:300], logits="none")
    for t in ids[300:310]:
        lc = sc.forward(np.array([t], np.int32), logits="last")
        lg = sg.forward(np.array([t], np.int32), logits="last")
        assert rel(lg, lc) < 3e-2
    assert sg.position == sc.position == 310
    np.testing.assert_array_equal(sg.cache_lengths(), sc.cache_lengths())
    np.testing.assert_array_equal(sg.cache_positions(0, 0), np.arange(310))


@needs_gpu
def test_logits_with_the_mma_attention_kernel(model_pair, rng, attention_kernel):
    path, cpu, gpu = model_pair
    ids = rng.integers(3, cpu.config["vocab"], size=260).astype(np.int32)
    assert rel(gpu.logits(ids), cpu.logits(ids)) < 3e-2


@needs_gpu
def test_decode_as_cuda_graph_matches_eager(model_pair, rng, tmp_path):
    """KVC_CUDA_GRAPHS=1 (read once per process): decode steps replayed from a captured graph give the
    logits of eager steps. Runs in a child process so the setting does not leak into other tests."""
    import subprocess
    import sys
    path = model_pair[0]
    code = f"""
import numpy as np, kvpress_c
m = kvpress_c.load_model({path!r}, device="cuda")
ids = np.random.default_rng(0).integers(3, m.config["vocab"], size=120).astype(np.int32)
out = []
for _ in range(2):
    s = m.new_session()
    s.forward(ids[:100], logits="none")
    out.append(np.stack([s.forward(ids[100 + i:101 + i], logits="last") for i in range(20)]))
    assert s.position == 120 and (s.cache_lengths() == 120).all()
np.save({str(tmp_path / "graph.npy")!r}, out[0])
"""
    for graphs in ("1", "0"):
        env = dict(os.environ, KVC_CUDA_GRAPHS=graphs)
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        os.replace(tmp_path / "graph.npy", tmp_path / f"graphs{graphs}.npy")
    a, b = np.load(tmp_path / "graphs1.npy"), np.load(tmp_path / "graphs0.npy")
    assert rel(a, b) < 1e-5


@needs_gpu
def test_greedy_generation_runs_like_cpu(model_pair, rng):
    _, cpu, gpu = model_pair
    ids = rng.integers(3, cpu.config["vocab"], size=64).tolist()
    a = cpu.generate(ids, max_new_tokens=8, stop_ids=[])
    b = gpu.generate(ids, max_new_tokens=8, stop_ids=[])
    assert len(a) == len(b) == 8
    # random weights have near-ties that bf16 may flip: the GPU's first token is among the CPU's best
    first = cpu.logits(ids)[-1]
    assert b[0] in np.argsort(first)[-3:]


@needs_gpu
def test_forward_batch_equals_single_decodes(model_pair, rng):
    _, _, gpu = model_pair
    V = gpu.config["vocab"]
    sessions, singles = [], []
    for L in (40, 77, 5):
        ids = rng.integers(3, V, size=L).astype(np.int32)
        a, b = gpu.new_session(), gpu.new_session()
        a.forward(ids, logits="none")
        b.forward(ids, logits="none")
        sessions.append(a)
        singles.append(b)
    nxt = rng.integers(3, V, size=3).astype(np.int32)
    batch = kvpress_c._core.forward_batch(sessions, nxt)
    for i, s in enumerate(singles):
        assert rel(batch[i], s.forward(nxt[i:i + 1], logits="last")) < 2e-2


def hf_on_gpu(path):
    """(torch, transformers, the HF model of `path` in bf16 on the GPU), or a skip with the reason."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    return torch, transformers, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()


@needs_gpu
def test_logits_match_hf_transformers_on_gpu(model_pair, rng):
    path, _, gpu = model_pair
    torch, _, hf = hf_on_gpu(path)
    ids = rng.integers(3, gpu.config["vocab"], size=200).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    assert rel(gpu.logits(ids), ref) < 5e-2  # both bf16, different roundings
    del hf
    torch.cuda.empty_cache()


SESSION_PRESSES = {
    "snapkv": dict(scorer=5, compression_ratio=0.5, window=16),
    "adakv": dict(scorer=5, allocation=2, compression_ratio=0.5, window=16),
    "chunkkv-reuse": dict(scorer=5, compression_ratio=0.5, window=16, chunk_length=10, reuse_layers=2),
    "pyramidkv": dict(scorer=5, allocation=1, budget=128, window=16),
    "streaming": dict(scorer=0, compression_ratio=0.5),
    "knorm": dict(scorer=1, compression_ratio=0.5),
    "tova": dict(scorer=3, compression_ratio=0.5),
    "observed-host-fallback": dict(scorer=4, compression_ratio=0.5),
    "edie": dict(scorer=6, compression_ratio=0.5, window=16),
}


@needs_gpu
@pytest.mark.parametrize("name", sorted(SESSION_PRESSES))
def test_session_press_kept_rows_match_cpu(model_pair, rng, name):
    _, cpu, gpu = model_pair
    ids = rng.integers(3, cpu.config["vocab"], size=400).astype(np.int32)
    sc, sg = cpu.new_session(), gpu.new_session()
    for s in (sc, sg):
        s.set_press(record_scores=1, **SESSION_PRESSES[name])
    lc = sc.forward(ids, logits="last")
    lg = sg.forward(ids, logits="last")
    assert rel(lg, lc) < 5e-2
    lens_c, lens_g = sc.cache_lengths(), sg.cache_lengths()
    if name in ("streaming", "knorm", "tova", "snapkv", "pyramidkv", "edie") or name.startswith("chunkkv"):
        np.testing.assert_array_equal(lens_g, lens_c)
    else:  # Ada-KV / head budgets may move by a few rows when scores are near ties
        assert abs(int(lens_g.sum()) - int(lens_c.sum())) <= 0.02 * lens_c.sum() + 2
    js = []
    for l in range(cpu.config["n_layers"]):
        for h in range(cpu.config["n_kv_heads"]):
            js.append(jaccard(sg.cache_positions(l, h), sc.cache_positions(l, h)))
    if name == "streaming":
        assert min(js) == 1.0
    else:  # bf16 vs fp32 scores swap near-ties; a ChunkKV swap moves 10 rows, Ada-KV moves head budgets
        floor = 0.8 if name.startswith("chunkkv") else 0.85 if name == "adakv" else 0.9
        assert np.mean(js) > floor, (name, js)
    # memory really drops: the device cache holds only what is kept
    assert sg.cache_bytes <= sg.peak_cache_bytes
    # decoding continues on the compressed cache
    nxt = np.array([5], np.int32)
    assert rel(sg.forward(nxt, logits="last"), sc.forward(nxt, logits="last")) < 1e-1


@needs_gpu
def test_shared_prefill_followers_equal_separate_runs(model_pair, rng):
    _, _, gpu = model_pair
    ids = rng.integers(3, gpu.config["vocab"], size=300).astype(np.int32)
    cfgs = [SESSION_PRESSES["snapkv"], SESSION_PRESSES["knorm"], SESSION_PRESSES["edie"]]
    leader, followers = gpu.new_session(), [gpu.new_session() for _ in cfgs]
    for f, c in zip(followers, cfgs):
        f.set_press(**c)
    leader.forward_shared(ids, followers)
    for f, c in zip(followers, cfgs):
        alone = gpu.new_session()
        alone.set_press(**c)
        alone.forward(ids, logits="none")
        assert f.position == alone.position == len(ids)
        np.testing.assert_array_equal(f.cache_lengths(), alone.cache_lengths())
        for l in range(gpu.config["n_layers"]):
            for h in range(gpu.config["n_kv_heads"]):
                np.testing.assert_array_equal(f.cache_positions(l, h), alone.cache_positions(l, h))


@needs_gpu
def test_one_token_shared_forward_reaches_the_followers(model_pair, rng):
    """A 1-token shared forward gives each follower that row, as on the CPU (no press acts on it)."""
    _, cpu, gpu = model_pair
    ids = rng.integers(3, gpu.config["vocab"], size=1).astype(np.int32)
    for model in (cpu, gpu):
        leader, followers = model.new_session(), [model.new_session() for _ in range(2)]
        followers[0].set_press(**SESSION_PRESSES["snapkv"])
        leader.forward_shared(ids, followers)
        for f in followers:
            assert f.position == 1
            np.testing.assert_array_equal(f.cache_lengths(), np.ones_like(f.cache_lengths()))


@needs_gpu
def test_sessions_on_two_threads_match_one_at_a_time(model_pair, rng):
    """The Python module releases the GIL; device calls from two threads take turns on the one stream
    (and the decode graph), so each thread's logits equal a run on its own."""
    import threading
    _, _, gpu = model_pair
    prompts = [rng.integers(3, gpu.config["vocab"], size=n).astype(np.int32) for n in (200, 333)]

    def run(ids):
        s = gpu.new_session()
        out = [s.forward(ids, logits="last")]
        for _ in range(12):
            out.append(s.forward(np.array([int(np.argmax(out[-1]))], dtype=np.int32), logits="last"))
        return np.stack(out)

    want = [run(p) for p in prompts]
    got, errors = [None, None], []

    def worker(i):
        try:
            got[i] = run(prompts[i])
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@needs_gpu
@pytest.mark.parametrize("kind", ["judgeq", "take"])
def test_a_press_on_a_shared_prefill_matches_its_own_prefill(model_pair, rng, kind):
    _, _, gpu = model_pair
    cfg = gpu.config
    ids = rng.integers(3, cfg["vocab"], size=300).astype(np.int32)
    if kind == "judgeq":
        soft = rng.normal(0, 1, size=(8, cfg["hidden"])).astype(np.float32)
        presses = [kvpress_c.JudgeQPress(soft_embeddings=soft, budget=b) for b in (32, 100)]
    else:
        presses = [kvpress_c.TAKEPress(budget=b, probe=rng.integers(3, cfg["vocab"], size=8)) for b in (32, 100)]
    leader, followers = gpu.new_session(), [gpu.new_session() for _ in presses]
    leader.forward_shared(ids, followers)
    for p, f in zip(presses, followers):
        p.compress_full_cache(f, ids, cfg)
        alone = gpu.new_session()
        p.prefill(alone, ids, cfg)
        assert f.position == alone.position == len(ids)
        # the extra rows' GEMMs run on 8 rows here and on 308 there (other cuBLAS algorithms, other bf16
        # roundings), so near-ties may fall the other way: the kept sets agree up to those
        overlap = []
        for l in range(cfg["n_layers"]):
            for h in range(cfg["n_kv_heads"]):
                a, b = set(f.cache_positions(l, h).tolist()), set(alone.cache_positions(l, h).tolist())
                assert len(a) == len(b) == p.budget
                overlap.append(len(a & b) / p.budget)
        assert min(overlap) >= 0.8 and np.mean(overlap) >= 0.95, overlap


@needs_gpu
def test_copy_cache_from_on_the_gpu(model_pair, rng):
    from cache_checks import ragged_copy
    _, cpu, gpu = model_pair
    ids = rng.integers(3, gpu.config["vocab"], size=200).astype(np.int32)
    step = rng.integers(3, gpu.config["vocab"], size=2).astype(np.int32)
    src, dst = ragged_copy(gpu, ids)
    assert rel(dst.forward(step, logits="all"), src.forward(step, logits="all")) < 1e-3
    with pytest.raises(ValueError, match="different models"):
        cpu.new_session().copy_cache_from(src)


@needs_gpu
@pytest.mark.parametrize("budget,chunk", [(64, 128), (200, 1000)])
def test_take_chunked_prefill_matches_cpu(model_pair, rng, budget, chunk):
    _, cpu, gpu = model_pair
    ids = rng.integers(3, cpu.config["vocab"], size=700).astype(np.int32)
    probes = rng.integers(3, cpu.config["vocab"], size=8).astype(np.int32)
    sc, sg = cpu.new_session(), gpu.new_session()
    lc = sc.prefill_take(ids, probes, budget, chunk)
    lg = sg.prefill_take(ids, probes, budget, chunk)
    assert rel(lg, lc) < 5e-2
    assert sg.position == sc.position == len(ids)
    np.testing.assert_array_equal(sg.cache_lengths(), sc.cache_lengths())
    js = [jaccard(sg.cache_positions(l, h), sc.cache_positions(l, h))
          for l in range(cpu.config["n_layers"]) for h in range(cpu.config["n_kv_heads"])]
    assert np.mean(js) > 0.85, js


@needs_gpu
def test_out_of_memory_is_an_exception_and_the_model_survives(model_pair, rng):
    _, _, gpu = model_pair
    ids = rng.integers(3, gpu.config["vocab"], size=50).astype(np.int32)
    before = gpu.logits(ids)
    with pytest.raises(MemoryError, match="CUDA out of memory"):
        gpu.new_session(capacity=1 << 40)  # a 2^40-token cache per head: far beyond any GPU
    s = gpu.new_session()
    s.forward(ids[:10], logits="none")
    with pytest.raises(MemoryError):
        s.forward(rng.integers(3, gpu.config["vocab"], size=1 << 27).astype(np.int32), logits="none")
    # the failed call lost nothing and the model works as before
    assert s.position == 10
    np.testing.assert_array_equal(s.cache_lengths(), np.full_like(s.cache_lengths(), 10))
    assert rel(gpu.logits(ids), before) < 1e-5
    stats = kvpress_c._core.cuda_memory_stats()
    assert stats["weights"] > 0 and stats["peak"] >= stats["current"] > 0


# ---------------------------------------------------------------------------------------------- #
# Llama-3.1-8B shapes (the model): HF parity, and TAKE's memory at 128k tokens             #
# ---------------------------------------------------------------------------------------------- #

@pytest.fixture(scope="module")
def llama8b():
    """(path, model on the GPU): the bf16 8B-shaped folder (16 GB, random_llama.llama31_8b_dir())."""
    if not HAS_CUDA:
        pytest.skip(_why_no_cuda())
    path = write_llama31_bf16(llama31_8b_dir())
    return path, kvpress_c.load_model(path, device="cuda")


# bf16 against bf16 through 32 layers. Measured on the CPU (256 tokens, these weights): fp32 kvpress_c
# against HF in bf16 differs by 0.015 / 0.032 / 0.045 (max |diff| / max |logit|) at 2 / 8 / 16 layers,
# growing as sqrt(layers): ~0.064 at 32, and ~0.09 between two bf16 implementations (sqrt(2) more).
# A wrong kernel gives O(1).
LLAMA8B_TOL = 0.15


@needs_gpu
def test_llama8b_logits_match_hf_transformers_on_gpu(llama8b, rng):
    path, gpu = llama8b
    torch, transformers, hf = hf_on_gpu(path)
    ids = rng.integers(1000, LLAMA31_8B["vocab"] - 1000, size=300)
    steps = rng.integers(1000, LLAMA31_8B["vocab"] - 1000, size=4)
    s = gpu.new_session()
    ours = [s.forward(ids.astype(np.int32), logits="all")]
    ours += [s.forward(np.array([t], np.int32), logits="last") for t in steps]
    del s
    cache = transformers.DynamicCache()
    with torch.no_grad():
        out = hf(torch.tensor(ids[None], device="cuda"), past_key_values=cache, use_cache=True)
        ref = [out.logits[0].float().cpu().numpy()]
        for t in steps:
            out = hf(torch.tensor([[t]], device="cuda"), past_key_values=cache, use_cache=True)
            ref.append(out.logits[0, -1].float().cpu().numpy())
    del hf, cache
    torch.cuda.empty_cache()
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert rel(a, b) < LLAMA8B_TOL, ("prefill" if i == 0 else f"decode step {i}", rel(a, b))


@needs_gpu
def test_llama8b_take_at_128k_stays_within_weights_plus_3_gb(llama8b, rng):
    """TAKE's device memory does not grow with the prompt: at 131,072 tokens the peak stays within the
    weights + 3 GB (the issue's bound; the full cache alone would be 17.2 GB), and every head of
    every layer ends with `budget` rows."""
    core = kvpress_c._core
    gpu = llama8b[1]
    n, budget = 131072, 2048
    ids = rng.integers(1000, LLAMA31_8B["vocab"] - 1000, size=n).astype(np.int32)
    press = kvpress_c.TAKEPress(budget=budget)
    s = gpu.new_session()
    core.cuda_reset_peak()
    logits = press.prefill(s, ids, gpu.config)
    st = core.cuda_memory_stats()
    assert np.isfinite(logits).all()
    assert s.position == n
    np.testing.assert_array_equal(s.cache_lengths(), np.full_like(s.cache_lengths(), budget))
    full_cache = n * LLAMA31_8B["layers"] * LLAMA31_8B["kv_heads"] * LLAMA31_8B["head_dim"] * 2 * 2
    over = st["peak"] - st["weights"]
    print(f"TAKE 128k: peak {st['peak'] / 1e9:.2f} GB = weights {st['weights'] / 1e9:.2f} GB + {over / 1e9:.2f} GB "
          f"(cache peak {st['cache_peak'] / 1e9:.2f} GB, activations peak {st['activations_peak'] / 1e9:.2f} GB; "
          f"full cache {full_cache / 1e9:.1f} GB)")
    assert over <= 3e9
    assert st["cache_peak"] < full_cache / 8


@needs_gpu
def test_cuda_info_and_memory_stats():
    info = kvpress_c._core.cuda_init()
    assert info["device"] and info["gemm"]
    kvpress_c._core.cuda_reset_peak()
    st = kvpress_c._core.cuda_memory_stats()
    assert st["peak"] == st["current"] and st["device_total"] > 0
