"""The devices against the CPU (the reference): the emulated device on every run (CI), CUDA where a GPU is.

Every test takes `device`: "emulated" always, "cuda" when kvpress_c.cuda_available() (else that case is
skipped with the reason). The emulated device runs the device path of the one engine on the CPU with
the CUDA backend's storage (bf16 weights, activations and cache, fp32 residual stream), so on CI these
tests run every host-side line a GPU session runs. Inputs are fresh random draws each run (seed printed
on failure).

Tolerances. Kernel tests feed bf16-exact inputs, so a device differs from the CPU by the rounding of its
output (one bf16 rounding, 2^-8 relative) and, for CUDA's flash attention, its bf16 probabilities.
Whole-model tests: bf16 roundings at every activation compound; the bounds below were measured with the
emulated device against the CPU (fp32) over 20 seeds on each test shape (MODEL_TOL's comment), and the
CUDA device is held to the same bound (the emulated device rounds where it rounds; what it does not
emulate, bf16 softmax probabilities inside the flash kernel and summation order, is of the same order).
The tests named llama8b write a 16 GB Llama-3.1-8B-shaped model and run on CUDA only (`-k "not llama8b"`).
"""
from __future__ import annotations

import ctypes as C
import os

import numpy as np
import pytest

import kvpress_c
from capi import ALLOCATIONS as A, DEVICES, SCORERS as S, CError, check, lib, press_compute, press_config, why_no_cuda
from random_llama import LLAMA31_8B, llama31_8b_dir, write_llama31_bf16, write_random_llama

HAS_CUDA = kvpress_c.cuda_available()
BF16_EPS = 2.0 ** -8
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason=why_no_cuda() or "no CUDA backend")


def bf16(x):
    """Round to the nearest bf16 (ties to even), returned as float32: what the device computes on."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).reshape(x.shape)


def rel(a, ref):
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(np.asarray(a, np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))


def dev(device):
    return DEVICES[device]


# ---------------------------------------------------------------------------------------------- #
# without a GPU: a clear error, never a crash                                                      #
# ---------------------------------------------------------------------------------------------- #

@pytest.mark.skipif(HAS_CUDA, reason="a GPU is available: the no-GPU behaviour cannot be observed")
def test_without_gpu_cuda_is_unavailable_with_a_clear_error(tmp_path):
    assert kvpress_c.cuda_available() is False and kvpress_c.device_available("emulated") is True
    assert lib.kvc_device_available(1) == 0
    path = write_random_llama(str(tmp_path / "m"), layers=1, hidden=64, heads=2, kv_heads=1, ffn=64, vocab=64)
    with pytest.raises(RuntimeError, match=r"CUDA backend not available: .+; use device='cpu'"):
        kvpress_c.load_model(path, device="cuda")
    with pytest.raises(RuntimeError, match="CUDA backend not available"):
        kvpress_c.device_info("cuda")
    with pytest.raises(ValueError, match="device must be"):
        kvpress_c.load_model(path, device="tpu")
    # the C entry points fail with a status and a message, nothing aborts
    a = np.ones((2, 2), np.float32)
    st = lib.kvc_device_kernel_matmul(1, a, a, np.zeros((2, 2), np.float32), 2, 2, 2)
    assert st == 6 and b"CUDA backend not available" in lib.kvc_last_error()
    q, kv = np.ones((20, 4, 16), np.float32), np.ones((2, 20, 16), np.float32)
    with pytest.raises(CError, match="CUDA backend not available"):
        device_press_compute("cuda", press_config(scorer=S["edie"], compression_ratio=0.5, window=4), q, kv, kv, attn=q)
    # and the CPU path is untouched
    m = kvpress_c.load_model(path)
    assert m.device == "cpu" and m._core.device == "cpu"
    assert np.isfinite(m.logits([1, 2, 3])).all()


# ---------------------------------------------------------------------------------------------- #
# kernels against the CPU backend                                                                  #
# ---------------------------------------------------------------------------------------------- #

def _setting_fixture(name, setting, ids):
    """A fixture over the values 0, 1, ... of a device setting (one per id): each test runs with each, and the
    setting is back at 0 afterwards. A value the device cannot run here (cuDNN that does not load: the
    emulated device, a machine without libcudnn) skips with the device's reason."""
    @pytest.fixture(params=list(range(len(ids))), ids=ids, name=name)
    def fixture(request, device):
        st = lib.kvc_device_set_option(dev(device), setting.encode(), request.param)
        if st != 0 and "cuDNN attention is not available" in lib.kvc_last_error().decode():
            pytest.skip(lib.kvc_last_error().decode())
        check(st)
        yield request.param
        check(lib.kvc_device_set_option(dev(device), setting.encode(), 0))
    return fixture


gemm_mode = _setting_fixture("gemm_mode", "builtin_gemm", ["default-gemm", "builtin-gemm"])
# 2: cuDNN's SDPA for prefills (heads at one stride, no window); the own kernels for the rest
attention_kernel = _setting_fixture("attention_kernel", "attention_kernel", ["wmma-attention", "mma-attention",
                                                                             "cudnn-attention"])


@pytest.mark.parametrize("m,n,k", [(1, 4096, 512), (7, 33, 65), (300, 1000, 256)])
def test_matmul(rng, device, gemm_mode, m, n, k):
    a, b = bf16(rng.standard_normal((m, k))), bf16(rng.standard_normal((n, k)))
    c = np.zeros((m, n), np.float32)
    check(lib.kvc_device_kernel_matmul(dev(device), a, b, c, m, n, k))
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    assert rel(c, ref) < 1e-4  # exact bf16 products, fp32 sums, fp32 output


@pytest.mark.parametrize("rows,dim", [(1, 4096), (37, 576), (300, 128)])
def test_rmsnorm_with_residual(rng, device, rows, dim):
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    r = bf16(rng.standard_normal((rows, dim)))
    w = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    y, x_out = np.zeros_like(x), np.zeros_like(x)
    check(lib.kvc_device_kernel_rmsnorm(dev(device), x, r.ctypes.data, w, y, x_out.ctypes.data, rows, dim, 1e-5))
    xs = (x + r).astype(np.float32)
    ref = np.zeros_like(x)
    check(lib.kvc_kernel_rmsnorm(xs, w, ref, rows, dim, 1e-5))
    assert rel(x_out, xs) < 1e-6
    assert rel(y, ref) < 2 * BF16_EPS  # one rounding of the output


@pytest.mark.parametrize("pairing", [0, 1])
@pytest.mark.parametrize("n,heads,d", [(5, 4, 64), (64, 8, 128), (3, 2, 16)])
def test_rope(rng, device, pairing, n, heads, d):
    x = bf16(rng.standard_normal((n, heads, d)))
    pos = np.sort(rng.integers(0, 131072, size=n)).astype(np.int64)
    inv = (500000.0 ** (-np.arange(0, d, 2) / d)).astype(np.float32)
    ours, ref = x.copy(), x.copy()
    check(lib.kvc_device_kernel_rope(dev(device), ours, pos, n, heads, d, inv, pairing))
    check(lib.kvc_kernel_rope(ref, pos, n, heads, d, inv, pairing))
    assert rel(ours, ref) < 2 * BF16_EPS


@pytest.mark.parametrize("rows,dim", [(1, 14336), (33, 1536)])
def test_swiglu(rng, device, rows, dim):
    g, u = bf16(rng.standard_normal((rows, dim)) * 3), bf16(rng.standard_normal((rows, dim)))
    ours, ref = np.zeros_like(g), np.zeros_like(g)
    check(lib.kvc_device_kernel_swiglu(dev(device), g, u, ours, rows, dim))
    check(lib.kvc_kernel_swiglu(g, u, ref, rows, dim))
    assert rel(ours, ref) < 2 * BF16_EPS


def run_attention(fn, q, ks, vs, past, scale, *extra, device=None, start=None, cap=None):
    """fn: kvc_kernel_attention (no device), or kvc_device_kernel_attention on `device` (window `start`; with cap,
    kvc_device_kernel_attention_softcap)."""
    n, H, d = q.shape
    Hkv = len(ks)
    kp = (C.c_void_p * Hkv)(*[k.ctypes.data for k in ks])
    vp = (C.c_void_p * Hkv)(*[v.ctypes.data for v in vs])
    out = np.zeros((n, H, d), np.float32)
    window = [None if start is None else start.ctypes.data] if device else []
    args = ([dev(device)] if device else []) + [q, n, H, Hkv, d, C.cast(kp, C.c_void_p), C.cast(vp, C.c_void_p), past,
                                                  *window, scale, *([] if cap is None else [cap]), out, *extra]
    check(fn(*args))
    return out


@pytest.mark.parametrize("n,H,Hkv,d", [(1, 32, 8, 128), (1, 9, 3, 64), (100, 8, 2, 128), (257, 4, 4, 64),
                                       (70, 6, 2, 32), (1, 4, 1, 16),
                                       # head dims the mma kernel cannot do: attention_kernel 1 falls back
                                       (40, 4, 2, 80), (33, 4, 4, 96), (20, 2, 1, 256)])
@pytest.mark.parametrize("force_prefill", [0, 1])
def test_attention_ragged(rng, device, attention_kernel, n, H, Hkv, d, force_prefill):
    past = rng.integers(0, 3000, size=Hkv).astype(np.int64)
    past[0] = 0  # a head with no past: the first query sees only itself
    q = bf16(rng.standard_normal((n, H, d)) * 2)
    ks = [bf16(rng.standard_normal((int(p) + n, d))) for p in past]
    vs = [bf16(rng.standard_normal((int(p) + n, d))) for p in past]
    scale = 1 / np.sqrt(d)
    ours = run_attention(lib.kvc_device_kernel_attention, q, ks, vs, past, scale, force_prefill, device=device)
    ref = run_attention(lib.kvc_kernel_attention, q, ks, vs, past, scale)
    # probabilities rounded to bf16 before P V (CUDA flash) or fp32 throughout; output rounded once
    assert rel(ours, ref) < 1.5e-2


def test_attention_long_decode_split_k(rng, device):
    H, d, n = 32, 128, 1
    past = np.array([30000, 5, 19000, 1, 0, 7777, 12345, 31], np.int64)  # 8 KV heads
    q = bf16(rng.standard_normal((n, H, d)) * 3)
    ks = [bf16(rng.standard_normal((int(p) + n, d))) for p in past]
    vs = [bf16(rng.standard_normal((int(p) + n, d))) for p in past]
    ours = run_attention(lib.kvc_device_kernel_attention, q, ks, vs, past, 1 / np.sqrt(d), 0, device=device)
    ref = run_attention(lib.kvc_kernel_attention, q, ks, vs, past, 1 / np.sqrt(d))
    assert rel(ours, ref) < 1e-2


def topk_ref(s, k):
    order = sorted(range(len(s)), key=lambda r: (-(s[r] if not np.isnan(s[r]) else -np.inf), r))
    return np.sort(np.array(order[:k], np.int64))


@pytest.mark.parametrize("n", [1, 17, 1000, 131072])
def test_topk_with_ties_and_nan(rng, device, n):
    heads = 3
    s = rng.integers(0, 20, size=(heads, n)).astype(np.float32)  # many ties: lower row wins
    s[0, : n // 3] = np.nan
    s[1, ::2] = -0.0
    s[1, 1::2] = 0.0
    k = np.array([n // 2, max(n - 1, 1), 1], np.int64)
    keep = np.full((heads, n), -1, np.int64)
    check(lib.kvc_device_kernel_topk(dev(device), s, heads, n, k, keep))
    for h in range(heads):
        kk = min(int(k[h]), n)
        if n <= 1000:
            np.testing.assert_array_equal(keep[h, :kk], topk_ref(s[h], kk))
        else:
            key = np.where(np.isnan(s[h]), -np.inf, s[h]).astype(np.float64)
            ref = np.sort(np.lexsort((np.arange(n), -key))[:kk])
            np.testing.assert_array_equal(keep[h, :kk], ref)


def device_press_compute(device, cfg, q, k, v, layer=0, n_layers=1, attn=None):
    """capi.press_compute on a device (kvc_device_press_compute)."""
    return press_compute(cfg, q, k, v, layer=layer, n_layers=n_layers, attn=attn, device=device)


def jaccard(a, b):
    a, b = set(np.asarray(a).tolist()), set(np.asarray(b).tolist())
    return len(a & b) / max(len(a | b), 1)


PRESSES = {
    "snapkv": dict(scorer=S["snapkv"], compression_ratio=0.5, window=16),
    "snapkv-max-reduce-first": dict(scorer=S["snapkv"], compression_ratio=0.7, window=8, pool_max=1, gqa_max=1, pool_then_reduce=0),
    "pyramidkv": dict(scorer=S["snapkv"], allocation=A["pyramid"], budget=96, window=16),
    "adakv": dict(scorer=S["snapkv"], allocation=A["adakv"], compression_ratio=0.5, window=16),
    "chunkkv": dict(scorer=S["snapkv"], compression_ratio=0.5, window=16, chunk_length=10),
    "tova": dict(scorer=S["tova"], compression_ratio=0.5, window=0),
    "knorm": dict(scorer=S["knorm"], compression_ratio=0.5, window=0),
    "streaming": dict(scorer=S["streaming"], compression_ratio=0.5, window=0),
    "random": dict(scorer=S["random"], compression_ratio=0.5, window=0, seed=7),
    "observed": dict(scorer=S["observed"], compression_ratio=0.5, window=0),  # scored on the host from downloaded rows
    "edie": dict(scorer=S["edie"], compression_ratio=0.5, window=16),
    "edie-wide-window": dict(scorer=S["edie"], compression_ratio=0.3, window=120, kernel=5, edie_alpha=0.3),
    "edie-no-mid-range": dict(scorer=S["edie"], compression_ratio=0.5, window=170),  # (w, len - 2w] empty: every past row
    "edie-long-cache": dict(scorer=S["edie"], compression_ratio=0.5, window=32),  # 2,500 rows: the kernel's 1,024-row chunks
    # issue 16: kvpress's scorers, on the host from the device's rows and queries (LagKV's ranks are compared
    # in the session test: a bf16 near-tie moves a rank by a whole step)
    "keydiff": dict(scorer=S["keydiff"], compression_ratio=0.5, window=0),
    "lagkv-cross": dict(scorer=S["lagkv"], compression_ratio=0.5, window=0, lag_size=32, cross_scoring=1),
    "expected_attention": dict(scorer=S["expected_attention"], compression_ratio=0.5, window=0),
    "expected_attention-no-cov": dict(scorer=S["expected_attention"], compression_ratio=0.9, window=0, use_covariance=0),
    # ChunkPress: each chunk scored alone in a scratch K/V store of the device
    "chunk_press-knorm": dict(scorer=S["knorm"], compression_ratio=0.7, window=0, chunk_press=64),
    "chunk_press-keydiff": dict(scorer=S["keydiff"], compression_ratio=0.5, window=0, chunk_press=100),
    # FinchPress: the question's attention, on the host from the device's rows and queries
    "finch": dict(scorer=S["finch"], compression_ratio=0.5, window=12, kernel=1),
    "finch-chunked": dict(scorer=S["finch"], compression_ratio=0.8, window=5, kernel=1, finch_chunk=128, finch_normalize=0),
    # SimLayerKV: lazy here (random rows put ~0.2 of the last queries' attention on 4 sinks + 100 recent rows)
    "simlayerkv": dict(scorer=S["simlayerkv"], window=3, kernel=1, n_sink=4, n_recent=100, lazy_threshold=0.05),
    # EntropyGatedChunkKV: ChunkKV's chunks, spiky ones cut to their top tokens
    "chunkkv-entropy-gated": dict(scorer=S["snapkv"], compression_ratio=0.7, window=16, chunk_length=10, low_entropy_chunk=4),
    # issue 16p: CapPress, on the host from the device's rows and queries
    "cap": dict(scorer=S["cap"], compression_ratio=0.5, window=0, epsilon=1e-6),
}
NO_PAST = {  # scorers of a prefill with no past: past = 0 in the test below
    "non_causal_attn": dict(scorer=S["non_causal_attn"], compression_ratio=0.5, window=0, attn_chunk=128),
    # ChunkPress over SnapKV: each chunk's last queries (rows of this call) moved to the prompt's last positions
    "chunk_press-snapkv": dict(scorer=S["snapkv"], compression_ratio=0.5, window=8, kernel=5, chunk_press=64),
}
PRESSES.update(NO_PAST)


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


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_press_scores_and_kept_rows_match_cpu(rng, device, name):
    n, H, Hkv, d, past = 300, 8, 2, 64, (2200 if name == "edie-long-cache" else 0 if name in NO_PAST else 200)
    length = past + n
    q = bf16(rng.standard_normal((n, H, d)) * 2)
    k = rng.standard_normal((Hkv, length, d))
    v = rng.standard_normal((Hkv, length, d))
    attn = None
    if name.startswith("edie"):  # EDIE also reads the queries' attention outputs
        attn, k, v = edie_inputs(rng, q, k, v, PRESSES[name]["window"])
    k, v = bf16(k), bf16(v)
    cfg = press_config(**PRESSES[name])
    s_dev, keep_dev = device_press_compute(device, cfg, q, k, v, layer=1, n_layers=4, attn=attn)
    s_cpu, keep_cpu = press_compute(press_config(**PRESSES[name]), q, k, v, layer=1, n_layers=4, attn=attn)
    assert rel(s_dev, s_cpu) < 2e-2
    if name == "adakv":  # head budgets follow the scores: compare the layer's whole selection
        flat = lambda keep: np.concatenate([h * length + k for h, k in enumerate(keep)])
        assert sum(map(len, keep_dev)) == sum(map(len, keep_cpu))
        assert jaccard(flat(keep_dev), flat(keep_cpu)) > 0.85
        return
    for h in range(Hkv):
        assert len(keep_dev[h]) == len(keep_cpu[h])
        if name in ("streaming", "random"):
            np.testing.assert_array_equal(keep_dev[h], keep_cpu[h])
        else:  # bf16 scores may swap near-ties at the cut (ChunkKV swaps 10 rows at a time)
            assert jaccard(keep_dev[h], keep_cpu[h]) > (0.8 if name.startswith("chunkkv") else 0.9), name


def test_press_missing_inputs_are_clear_errors(rng, device):
    q = rng.standard_normal((20, 4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 20, 16)).astype(np.float32)
    with pytest.raises(CError, match="EDIE needs the attention outputs"):
        device_press_compute(device, press_config(scorer=S["edie"], compression_ratio=0.5, window=4), q, k, k)
    with pytest.raises(CError, match="longer than the press window"):
        device_press_compute(device, press_config(scorer=S["snapkv"], compression_ratio=0.5, window=32), q, k, k)


# ---------------------------------------------------------------------------------------------- #
# a whole model                                                                                    #
# ---------------------------------------------------------------------------------------------- #

SHAPES = {"hd64": dict(layers=3, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=512),
          "hd128": dict(layers=2, hidden=1024, heads=8, kv_heads=2, ffn=1024, vocab=1000),
          "hd32-generic": dict(layers=2, hidden=128, heads=4, kv_heads=4, ffn=256, vocab=300)}

# max |device - cpu| / max |cpu| of the logits. Measured with the emulated device against the CPU over
# 20 seeds per shape (benchmarks/device_tolerance.py -> benchmarks/results/device_tolerance.json, 333-token
# prefill and 10 decode steps): prefill up to 0.055 (hd64; hd128 0.029, hd32 0.044), decode steps up to
# 0.064 (hd64). The old bound of 3e-2 would have failed a correct device. The bound is 1.5x the largest.
MEASURED = {"prefill": 0.0545, "decode": 0.0638}
MODEL_TOL = 1.5 * max(MEASURED.values())


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model_path(request, tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp(request.param)), **SHAPES[request.param])


@pytest.fixture(scope="module")
def cpu_model(model_path):
    return kvpress_c.load_model(model_path)


_loaded = {}


@pytest.fixture
def dev_model(model_path, device):
    """The model of model_path on `device`, loaded once per (path, device)."""
    key = (model_path, device)
    if key not in _loaded:
        _loaded.clear()  # one model on a device at a time
        _loaded[key] = kvpress_c.load_model(model_path, device=device)
    return _loaded[key]


def test_logits_prefill_and_decode_match_cpu(cpu_model, dev_model, rng, device):
    cpu, gpu = cpu_model, dev_model
    assert gpu.device == device and gpu._core.device == device
    V = cpu.config["vocab"]
    ids = rng.integers(3, V, size=333).astype(np.int32)
    ref = cpu.logits(ids)
    ours = gpu.logits(ids)
    assert rel(ours, ref) < MODEL_TOL
    # decode steps on the device cache against the CPU
    sc, sg = cpu.new_session(), gpu.new_session()
    sc.forward(ids[:300], logits="none")
    sg.forward(ids[:300], logits="none")
    for t in ids[300:310]:
        lc = sc.forward(np.array([t], np.int32), logits="last")
        lg = sg.forward(np.array([t], np.int32), logits="last")
        assert rel(lg, lc) < MODEL_TOL
    assert sg.position == sc.position == 310
    np.testing.assert_array_equal(sg.cache_lengths(), sc.cache_lengths())
    np.testing.assert_array_equal(sg.cache_positions(0, 0), np.arange(310))


@needs_gpu
def test_cuda_logits_match_the_emulated_device(model_path, rng):
    """The emulated device rounds where the CUDA backend rounds: the two agree more closely than either
    agrees with the fp32 CPU (what remains: bf16 probabilities inside the flash kernel, summation order)."""
    ids = rng.integers(3, 250, size=300).astype(np.int32)
    emu = kvpress_c.load_model(model_path, device="emulated").logits(ids)
    cuda = kvpress_c.load_model(model_path, device="cuda").logits(ids)
    assert rel(cuda, emu) < MODEL_TOL


def test_cudnn_attention_kernel_runs_or_says_why(device):
    """attention_kernel 2 (cuDNN's SDPA) either runs or is refused with the reason (cuDNN absent, the emulated
    device), never silently replaced: a refusal leaves the kernel that was in use."""
    try:
        kvpress_c._core.set_device_option(device, "attention_kernel", 2)
    except NotImplementedError as e:
        assert "cuDNN attention is not available" in str(e)
        if device == "emulated":
            assert "emulated device" in str(e)
    finally:
        kvpress_c._core.set_device_option(device, "attention_kernel", 0)
    with pytest.raises(ValueError):
        kvpress_c._core.set_device_option(device, "attention_kernel", 3)


def test_logits_with_the_mma_attention_kernel(cpu_model, dev_model, rng, device, attention_kernel):
    ids = rng.integers(3, cpu_model.config["vocab"], size=260).astype(np.int32)
    assert rel(dev_model.logits(ids), cpu_model.logits(ids)) < MODEL_TOL


def test_decode_graph_replays_the_eager_steps(dev_model, rng):
    """Decode steps replayed from a graph (recorded and replayed on the emulated device, a CUDA graph on
    the GPU): the first step after enabling runs eagerly, every later one as the graph, and the logits
    equal those of eager steps; growing the cache (a reallocation of every layer's arena) keeps it valid."""
    m = dev_model
    ids = np.random.default_rng(0).integers(3, m.config["vocab"], size=120).astype(np.int32)
    out = []
    for graphs in (True, False):
        s = m.new_session()
        s.forward(ids[:100], logits="none")
        s.set_decode_graphs(graphs)
        out.append(np.stack([s.forward(ids[100 + i:101 + i], logits="last") for i in range(20)]))
        assert s.position == 120 and (s.cache_lengths() == 120).all()
        np.testing.assert_array_equal(s.cache_positions(0, 0), np.arange(120))
        info = s.graph_info
        assert info["enabled"] == graphs and info["error"] == ""
        assert info["graph_steps"] == (19 if graphs else 0)  # the first step ran eagerly
    assert rel(out[0], out[1]) < 1e-5


def test_decode_graph_recapture_after_activation_growth_runs_an_eager_step_first(dev_model):
    """A longer forward replaces the activations a captured graph holds: the next decode step runs eagerly
    (it sizes the backend's scratch outside a capture), the one after captures again, and the logits equal
    those of eager steps."""
    m = dev_model
    ids = np.random.default_rng(1).integers(3, m.config["vocab"], size=100).astype(np.int32)
    out, steps = [], []
    for graphs in (True, False):
        s = m.new_session()
        s.forward(ids[:4], logits="none")
        s.set_decode_graphs(graphs)
        rows = [s.forward(ids[4 + i:5 + i], logits="last") for i in range(5)]  # 1 eager, 4 replayed
        steps.append(s.graph_info["graph_steps"])
        s.forward(ids[9:90], logits="none")  # 81 rows: more activations than the 4-row prefill had
        rows += [s.forward(ids[90 + i:91 + i], logits="last") for i in range(5)]
        steps.append(s.graph_info["graph_steps"])
        assert s.graph_info["error"] == ""
        out.append(np.stack(rows))
    assert steps == [4, 8, 0, 0]  # after the growth: 1 eager step again, then 4 replayed
    assert rel(out[0], out[1]) < 1e-5


def test_decode_graph_is_refused_on_the_cpu(cpu_model):
    with pytest.raises(NotImplementedError, match="no graphs"):
        cpu_model.new_session().set_decode_graphs(True)


def test_greedy_generation_runs_like_cpu(cpu_model, dev_model, rng):
    ids = rng.integers(3, cpu_model.config["vocab"], size=64).tolist()
    a = cpu_model.generate(ids, max_new_tokens=8, stop_ids=[])
    b = dev_model.generate(ids, max_new_tokens=8, stop_ids=[])
    assert len(a) == len(b) == 8
    # random weights have near-ties that bf16 may flip: the device's first token is among the CPU's best
    first = cpu_model.logits(ids)[-1]
    assert b[0] in np.argsort(first)[-3:]


def test_forward_batch_equals_single_decodes(dev_model, rng):
    V = dev_model.config["vocab"]
    sessions, singles = [], []
    for L in (40, 77, 5):
        ids = rng.integers(3, V, size=L).astype(np.int32)
        a, b = dev_model.new_session(), dev_model.new_session()
        a.forward(ids, logits="none")
        b.forward(ids, logits="none")
        sessions.append(a)
        singles.append(b)
    nxt = rng.integers(3, V, size=3).astype(np.int32)
    batch = kvpress_c._core.forward_batch(sessions, nxt)
    for i, s in enumerate(singles):
        assert rel(batch[i], s.forward(nxt[i:i + 1], logits="last")) < 2e-2


def hf_model(path, device):
    """(torch, transformers, the HF model of `path`: bf16 on the GPU for cuda, fp32 on the CPU for the
    emulated device), or a skip with the reason."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA here")
        return torch, transformers, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    return torch, transformers, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_logits_match_hf_transformers(model_path, dev_model, rng, device):
    torch, _, hf = hf_model(model_path, device)
    ids = rng.integers(3, dev_model.config["vocab"], size=200).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device=device if device == "cuda" else "cpu")).logits[0].float().cpu().numpy()
    # CUDA: both bf16 with different roundings (the measured bound for one side, sqrt(2) more for two);
    # emulated: bf16 against HF's fp32, the device-vs-CPU bound
    assert rel(dev_model.logits(ids), ref) < (1.5 if device == "cuda" else 1.0) * MODEL_TOL
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()


SESSION_PRESSES = {
    "snapkv": dict(scorer=S["snapkv"], compression_ratio=0.5, window=16),
    "adakv": dict(scorer=S["snapkv"], allocation=A["adakv"], compression_ratio=0.5, window=16),
    "chunkkv-reuse": dict(scorer=S["snapkv"], compression_ratio=0.5, window=16, chunk_length=10, reuse_layers=2),
    "pyramidkv": dict(scorer=S["snapkv"], allocation=A["pyramid"], budget=128, window=16),
    "streaming": dict(scorer=S["streaming"], compression_ratio=0.5),
    "knorm": dict(scorer=S["knorm"], compression_ratio=0.5),
    "tova": dict(scorer=S["tova"], compression_ratio=0.5),
    "observed": dict(scorer=S["observed"], compression_ratio=0.5),
    "edie": dict(scorer=S["edie"], compression_ratio=0.5, window=16),
    # issue 16: kvpress's scorers
    "keydiff": dict(scorer=S["keydiff"], compression_ratio=0.5),
    "lagkv": dict(scorer=S["lagkv"], compression_ratio=0.5, lag_size=32),
    "expected_attention": dict(scorer=S["expected_attention"], compression_ratio=0.9),
    "non_causal_attn": dict(scorer=S["non_causal_attn"], compression_ratio=0.5, attn_chunk=128),
    "leverage": dict(scorer=S["leverage"], compression_ratio=0.5, sketch_dim=16, seed=7),
    "cur": dict(scorer=S["cur"], compression_ratio=0.5, n_sink=4, cur_random=1, seed=3),
    "compactor": dict(scorer=S["compactor"], compression_ratio=0.5, attn_chunk=128, sketch_dim=16, seed=5,
                      cmp_sink_start=8, cmp_sink_end=4, cmp_blend=0.5),
    "critical_adakv": dict(scorer=S["expected_attention"], allocation=A["adakv"], compression_ratio=0.8, use_vnorm=0,
                           critical=1),
    "chunk_press": dict(scorer=S["keydiff"], compression_ratio=0.6, chunk_press=64),
    "chunk_press-snapkv": dict(scorer=S["snapkv"], compression_ratio=0.5, window=8, chunk_press=64),
    "finch": dict(scorer=S["finch"], compression_ratio=0.7, window=10, kernel=1, finch_chunk=100),
    # threshold 0: every layer lazy on both devices (a mass within bf16 rounding of a threshold could go either way)
    "simlayerkv": dict(scorer=S["simlayerkv"], window=1, kernel=1, n_sink=4, n_recent=150, lazy_threshold=0.0),
    "chunkkv-entropy-gated": dict(scorer=S["snapkv"], compression_ratio=0.5, window=16, chunk_length=10, low_entropy_chunk=4),
    "cap": dict(scorer=S["cap"], compression_ratio=0.5, epsilon=1e-6),
}
UNIFORM_ISSUE16 = ("keydiff", "lagkv", "expected_attention", "non_causal_attn", "leverage", "cur", "compactor",
                   "chunk_press", "chunk_press-snapkv", "finch", "simlayerkv", "cap")  # same budget for every head: equal lengths


@pytest.mark.parametrize("name", sorted(SESSION_PRESSES))
def test_session_press_kept_rows_match_cpu(cpu_model, dev_model, rng, name):
    cpu, gpu = cpu_model, dev_model
    ids = rng.integers(3, cpu.config["vocab"], size=400).astype(np.int32)
    sc, sg = cpu.new_session(), gpu.new_session()
    for s in (sc, sg):
        s.set_press(record_scores=1, **SESSION_PRESSES[name])
    lc = sc.forward(ids, logits="last")
    lg = sg.forward(ids, logits="last")
    assert rel(lg, lc) < MODEL_TOL
    lens_c, lens_g = sc.cache_lengths(), sg.cache_lengths()
    if name in ("streaming", "knorm", "tova", "snapkv", "pyramidkv", "edie", "observed") or name.startswith("chunkkv") \
            or name in UNIFORM_ISSUE16:
        np.testing.assert_array_equal(lens_g, lens_c)
    else:  # Ada-KV / head budgets may move by a few rows when scores are near ties
        assert abs(int(lens_g.sum()) - int(lens_c.sum())) <= 0.02 * lens_c.sum() + 2
    js = []
    for l in range(cpu.config["n_layers"]):
        for h in range(cpu.config["n_kv_heads"]):
            js.append(jaccard(sg.cache_positions(l, h), sc.cache_positions(l, h)))
        # the recorded diagnostics exist on every device: the scores, and Ada-KV's eviction loss (NaN where a
        # ChunkKV layer reused its group's rows and scored nothing, on both)
        assert len(sg.press_scores(l, 0)) == len(sc.press_scores(l, 0))
        assert np.isfinite(sg.press_error(l)) == np.isfinite(sc.press_error(l))
        # the eviction loss is a function of the rows kept: compared where the layer kept the same rows on both
        # devices. bf16 keys may flip near-ties of the ranking (the Jaccard above holds them to it), and a flipped
        # row moves the loss by more than rounding: seen on hd64, NonCausalAttn 13.56 vs 11.29 and
        # ObservedAttention 15.97 vs 12.99 at layer 0 with other rows kept
        same = all(js[-1 - h] == 1.0 for h in range(cpu.config["n_kv_heads"]))
        if np.isfinite(sc.press_error(l)) and same:
            assert abs(sg.press_error(l) - sc.press_error(l)) < 0.2 * sc.press_error(l) + 1e-3
    if name == "streaming":
        assert min(js) == 1.0
    else:  # bf16 vs fp32 scores swap near-ties; a ChunkKV swap moves 10 rows, Ada-KV moves head budgets
        floor = 0.8 if name.startswith("chunkkv") else 0.85 if name == "adakv" else 0.9
        assert np.mean(js) > floor, (name, js)
    # memory really drops: the device cache holds only what is kept
    assert sg.cache_bytes <= sg.peak_cache_bytes
    # decoding continues on the compressed cache; where the device kept other rows (near-ties), the
    # logits of a random-weight model move by much more than rounding: compare only identical caches
    nxt = np.array([5], np.int32)
    lg, lc = sg.forward(nxt, logits="last"), sc.forward(nxt, logits="last")
    assert np.isfinite(lg).all()
    if min(js) == 1.0:
        assert rel(lg, lc) < MODEL_TOL


def test_shared_prefill_followers_equal_separate_runs(dev_model, rng):
    gpu = dev_model
    ids = rng.integers(3, gpu.config["vocab"], size=300).astype(np.int32)
    cfgs = [SESSION_PRESSES["snapkv"], SESSION_PRESSES["knorm"], SESSION_PRESSES["edie"], SESSION_PRESSES["observed"]]
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


def test_one_token_shared_forward_reaches_the_followers(cpu_model, dev_model, rng):
    """A 1-token shared forward gives each follower that row, as on the CPU (no press acts on it)."""
    ids = rng.integers(3, dev_model.config["vocab"], size=1).astype(np.int32)
    for model in (cpu_model, dev_model):
        leader, followers = model.new_session(), [model.new_session() for _ in range(2)]
        followers[0].set_press(**SESSION_PRESSES["snapkv"])
        leader.forward_shared(ids, followers)
        for f in followers:
            assert f.position == 1
            np.testing.assert_array_equal(f.cache_lengths(), np.ones_like(f.cache_lengths()))


def test_sessions_on_two_threads_match_one_at_a_time(dev_model, rng):
    """The Python module releases the GIL; device calls from two threads take turns (one stream, shared
    scratch, the decode graph), so each thread's logits equal a run on its own."""
    import threading
    prompts = [rng.integers(3, dev_model.config["vocab"], size=n).astype(np.int32) for n in (200, 333)]

    def run(ids):
        s = dev_model.new_session()
        s.set_decode_graphs(True)
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


@pytest.mark.parametrize("kind", ["judgeq", "take"])
def test_a_press_on_a_shared_prefill_matches_its_own_prefill(dev_model, rng, kind):
    gpu = dev_model
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
        # the extra rows' GEMMs run on 8 rows here and on 308 there (on CUDA, other cuBLAS algorithms and
        # bf16 roundings), so near-ties may fall the other way: the kept sets agree up to those
        overlap = []
        for l in range(cfg["n_layers"]):
            for h in range(cfg["n_kv_heads"]):
                a, b = set(f.cache_positions(l, h).tolist()), set(alone.cache_positions(l, h).tolist())
                assert len(a) == len(b) == p.budget
                overlap.append(len(a & b) / p.budget)
        assert min(overlap) >= 0.8 and np.mean(overlap) >= 0.95, overlap


def test_copy_cache_from_on_the_device(cpu_model, dev_model, rng):
    from cache_checks import ragged_copy
    ids = rng.integers(3, dev_model.config["vocab"], size=200).astype(np.int32)
    step = rng.integers(3, dev_model.config["vocab"], size=2).astype(np.int32)
    src, dst = ragged_copy(dev_model, ids)
    assert rel(dst.forward(step, logits="all"), src.forward(step, logits="all")) < 1e-3
    with pytest.raises(ValueError, match="different models"):
        cpu_model.new_session().copy_cache_from(src)


@pytest.mark.parametrize("plus", [False, True])
def test_kvzip_scores_and_eviction_match_cpu(cpu_model, dev_model, rng, plus):
    """KVzip (issue 16): the reconstruction forward on the full cache (its rows dropped again), its scores and the
    global eviction, on the device against the CPU."""
    cpu, gpu = cpu_model, dev_model
    ids = rng.integers(3, cpu.config["vocab"], size=300).astype(np.int32)
    rep = np.r_[rng.integers(3, cpu.config["vocab"], size=8), ids[10:300]].astype(np.int32)
    sc, sg = cpu.new_session(), gpu.new_session()
    sc.forward(ids, logits="last")
    sg.forward(ids, logits="last")
    zc = sc.kvzip_score(rep, 10, 300, n_sink=4, plus=plus)
    zg = sg.kvzip_score(rep, 10, 300, n_sink=4, plus=plus)
    assert sg.position == sc.position == len(ids) and (sg.cache_lengths() == len(ids)).all()
    print(f"KVzip{'+' if plus else ''} scores rel err {rel(zg, zc):.3g}")
    # bf16 storage through a 300-token random-weight forward, then a max over peaked softmax rows: measured
    # 0.021 .. 0.079 over 8 runs x 3 shapes x 2 (the largest on hd64); the kept sets are what the test holds to
    assert rel(zg, zc) < 0.15, rel(zg, zc)
    full = np.zeros((cpu.config["n_layers"], cpu.config["n_kv_heads"], len(ids)), np.float32)
    sc.kvzip_evict(full + np.pad(zc, ((0, 0), (0, 0), (10, 0))), 0.7)
    sg.kvzip_evict(full + np.pad(zg, ((0, 0), (0, 0), (10, 0))), 0.7)
    assert sg.cache_lengths().sum() == sc.cache_lengths().sum()
    js = [jaccard(sg.cache_positions(l, h), sc.cache_positions(l, h))
          for l in range(cpu.config["n_layers"]) for h in range(cpu.config["n_kv_heads"])]
    assert np.mean(js) > 0.9, js  # bf16 swaps near-ties of the global ranking
    assert np.isfinite(sg.forward(np.array([5], np.int32), logits="last")).all()


@pytest.mark.parametrize("budget,chunk", [(64, 128), (200, 1000)])
def test_take_chunked_prefill_matches_cpu(cpu_model, dev_model, rng, budget, chunk):
    cpu, gpu = cpu_model, dev_model
    ids = rng.integers(3, cpu.config["vocab"], size=700).astype(np.int32)
    probes = rng.integers(3, cpu.config["vocab"], size=8).astype(np.int32)
    sc, sg = cpu.new_session(), gpu.new_session()
    lc = sc.prefill_take(ids, probes, budget, chunk)
    lg = sg.prefill_take(ids, probes, budget, chunk)
    assert sg.position == sc.position == len(ids)
    np.testing.assert_array_equal(sg.cache_lengths(), sc.cache_lengths())
    js = [jaccard(sg.cache_positions(l, h), sc.cache_positions(l, h))
          for l in range(cpu.config["n_layers"]) for h in range(cpu.config["n_kv_heads"])]
    # Each chunk's eviction decides what the next chunk sees, so rounding compounds over chunks: measured on
    # the emulated device over 10 seeds x 3 shapes, the mean Jaccard against the CPU was >= 0.95 for one
    # chunk (200 / 1000) but 0.50-0.71 (mean 0.68-0.77) for six chunks of 128 with budget 64 -- and the CPU
    # itself on bf16-rounded weights gets 0.58-0.73 against the CPU there: the method's sensitivity on
    # random weights, not the device. Six chunks: 90 more runs (30 seeds x 3 shapes, this stop) gave means
    # 0.511-0.99, and one CI seed (254601829, old code too) 0.437, so the tail is long; two unrelated sets of
    # 64 of 700 rows would give ~0.05. The floor sits far above that and under the tail.
    print(f"TAKE chunked prefill, device vs CPU: mean Jaccard {np.mean(js):.3f}, min {min(js):.3f}")
    assert np.mean(js) > (0.9 if chunk >= len(ids) else 0.3), js
    # later chunks attend to what earlier evictions kept: where the device kept other rows (near-ties), the
    # last chunk's logits move by much more than rounding, so they are compared only on identical caches
    assert np.isfinite(lg).all()
    if min(js) == 1.0:
        assert rel(lg, lc) < MODEL_TOL


def test_judgeq_gradient_of_a_device_model_equals_the_cpu_one(model_path, dev_model, rng, device):
    """Judge Q's backward runs on the host in fp32: a device model loads a CPU copy of its file on the
    first pair (once), so the loss and gradient equal the CPU model's bit for bit."""
    from kvpress_c import judgeq
    cpu = kvpress_c.load_model(model_path)
    V, D = cpu.config["vocab"], cpu.config["hidden"]
    p, r = rng.integers(3, V, size=40).tolist(), rng.integers(3, V, size=12).tolist()
    E = rng.normal(0, 0.5, size=(4, D)).astype(np.float32)
    l_cpu, g_cpu = judgeq.loss_and_grad(cpu, p, r, E)
    l_dev, g_dev = judgeq.loss_and_grad(dev_model, p, r, E)
    assert l_dev == l_cpu
    np.testing.assert_array_equal(g_dev, g_cpu)


def test_out_of_memory_is_an_exception_and_the_model_survives(dev_model, rng, device):
    gpu = dev_model
    ids = rng.integers(3, gpu.config["vocab"], size=50).astype(np.int32)
    before = gpu.logits(ids)
    with pytest.raises(MemoryError, match="out of memory"):
        gpu.new_session(capacity=1 << 40).forward(ids[:2], logits="none")  # a 2^40-token cache per head
    s = gpu.new_session()
    s.forward(ids[:10], logits="none")
    if device == "cuda":  # the emulated device's memory is this machine's: 2^27 tokens would just be slow
        with pytest.raises(MemoryError):
            s.forward(rng.integers(3, gpu.config["vocab"], size=1 << 27).astype(np.int32), logits="none")
    # the failed call lost nothing and the model works as before
    assert s.position == 10
    np.testing.assert_array_equal(s.cache_lengths(), np.full_like(s.cache_lengths(), 10))
    assert rel(gpu.logits(ids), before) < 1e-5
    stats = kvpress_c.memory_stats(device)
    assert stats["weights"] > 0 and stats["peak"] >= stats["current"] > 0


def test_device_info_and_memory_stats(dev_model, device):
    info = kvpress_c.device_info(device)
    assert info["device"] and info["gemm"]
    kvpress_c.memory_stats(device, reset_peak=True)
    st = kvpress_c.memory_stats(device)
    assert st["peak"] == st["current"] and st["weights"] > 0


# ---------------------------------------------------------------------------------------------- #
# loading onto a device: no host copy of the weights                                               #
# ---------------------------------------------------------------------------------------------- #

def test_a_device_load_holds_no_host_copy_of_the_weights(tmp_path):
    """Tensors go from the file to the device a bounded chunk at a time (16 MB of fp32), and the file's
    pages are given back after each: host memory beyond the device's own buffers stays near the largest
    chunk, not the model. Measured in a fresh process on a 150 MB bf16 model (the emulated device's
    buffers are host memory too: they are subtracted)."""
    from load_probe import measure
    shape = dict(layers=4, hidden=1024, heads=8, kv_heads=2, head_dim=128, ffn=4096, vocab=32000)
    path = write_llama31_bf16(str(tmp_path / "m"), shape)
    got = measure(path, "emulated")
    assert "error" not in got, got
    weights = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    hwm, rss = got["host_peak_beyond_device"], got["host_after_beyond_device"]
    print(f"emulated device load of {weights / 1e6:.0f} MB of bf16 weights: host memory beyond the device buffers "
          f"peak {hwm / 1e6:.1f} MB, after {rss / 1e6:.1f} MB; device buffers {got['device_bytes'] / 1e6:.0f} MB")
    assert got["device_bytes"] >= weights * 0.99
    assert hwm < 64e6 + 0.1 * weights  # the 16 MB chunk, its staging, the interpreter's own growth
    assert rss < 48e6


# ---------------------------------------------------------------------------------------------- #
# Llama-3.1-8B shapes (the issue's model): HF parity, and TAKE's memory at 128k tokens (CUDA)      #
# ---------------------------------------------------------------------------------------------- #

@pytest.fixture(scope="module")
def llama8b():
    """(path, model on the GPU): the bf16 8B-shaped folder (16 GB, random_llama.llama31_8b_dir())."""
    if not HAS_CUDA:
        pytest.skip(why_no_cuda())
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
    torch, transformers, hf = hf_model(path, "cuda")
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
    gpu = llama8b[1]
    n, budget = 131072, 2048
    ids = rng.integers(1000, LLAMA31_8B["vocab"] - 1000, size=n).astype(np.int32)
    press = kvpress_c.TAKEPress(budget=budget)
    s = gpu.new_session()
    kvpress_c.memory_stats("cuda", reset_peak=True)
    logits = press.prefill(s, ids, gpu.config)
    st = kvpress_c.memory_stats("cuda")
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


# ---------------------------------------------------------------------------------------------- #
# Qwen3's per-head q/k norm and sliding-window attention                                           #
# ---------------------------------------------------------------------------------------------- #

@pytest.mark.parametrize("n,heads,d", [(1, 16, 128), (37, 8, 64)])
def test_head_rmsnorm(rng, device, n, heads, d):
    x = bf16(rng.standard_normal((n, heads, d)) * 3)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    ours, ref = x.copy(), x.copy()
    check(lib.kvc_device_kernel_head_rmsnorm(dev(device), ours, n, heads, d, w, np.float32(1e-6)))
    check(lib.kvc_device_kernel_head_rmsnorm(0, ref, n, heads, d, w, np.float32(1e-6)))
    assert rel(ours, ref) < 2 * BF16_EPS  # one rounding of the output


@pytest.mark.parametrize("n,H,d,force_prefill", [(70, 8, 64, 0), (130, 4, 128, 0), (1, 8, 64, 0), (1, 4, 128, 1),
                                                  (9, 6, 40, 0)])
def test_attention_window_starts(rng, device, attention_kernel, n, H, d, force_prefill):
    """Window starts (i64 [n, Hkv], nondecreasing per head) on the device against the CPU: the prefill
    kernels (WMMA and mma at d 64 / 128, the generic one at d 40) and split-K decode (n = 1)."""
    past = np.array([90, 3], np.int64)  # 2 KV heads
    # starts from half the past on: the window then drops enough keys to move the output (drawn from 0, a start
    # of a few keys of 91 moved it by 0.043 on one CI seed, under the check below; from half: >= 0.255 over
    # 1200 draws of these shapes)
    start = np.stack([np.maximum.accumulate(rng.integers(p // 2, p + np.arange(n) + 1)) for p in past], 1).astype(np.int64)
    q = bf16(rng.standard_normal((n, H, d)))
    ks = [bf16(rng.standard_normal((int(p) + n, d))) for p in past]
    vs = [bf16(rng.standard_normal((int(p) + n, d))) for p in past]
    ours = run_attention(lib.kvc_device_kernel_attention, q, ks, vs, past, 0.125, force_prefill, device=device,
                         start=start)
    ref = run_attention(lib.kvc_device_kernel_attention, q, ks, vs, past, 0.125, 0, device="cpu", start=start)
    full = run_attention(lib.kvc_device_kernel_attention, q, ks, vs, past, 0.125, 0, device="cpu")
    assert rel(full, ref) > 0.05  # the starts change the output: a kernel ignoring them would fail below
    assert rel(ours, ref) < 1.5e-2  # as test_attention_ragged: bf16 probabilities and output of the same sums


@pytest.mark.parametrize("n,H,d,force_prefill", [(70, 8, 64, 0), (130, 4, 128, 0), (1, 8, 64, 0), (1, 4, 128, 1),
                                                  (9, 6, 40, 0)])
def test_attention_softcap(rng, device, attention_kernel, n, H, d, force_prefill):
    """Soft-capped scores (Gemma 2) on the device against the CPU: the prefill kernels (WMMA and mma at d 64 / 128,
    the generic one at d 40; cuDNN is skipped for a cap) and split-K decode (n = 1), with a sliding window that
    keeps at least 8 keys where the head has them: a window of 1-3 keys can leave the capped output as the plain
    one (one query row: 7 of 600 seeds under the 5% below, down to 0.5%; with 8 keys the least of 300 seeds a
    case was 14%)."""
    past = np.array([90, 3], np.int64)  # 2 KV heads
    start = np.stack([np.maximum.accumulate(rng.integers(0, np.maximum(p + np.arange(n) + 1 - 8, 1))) for p in past],
                     1).astype(np.int64)
    q = bf16(rng.standard_normal((n, H, d)) * 4)  # scaled scores well past the cap
    ks = [bf16(rng.standard_normal((int(p) + n, d))) for p in past]
    vs = [bf16(rng.standard_normal((int(p) + n, d))) for p in past]
    scale, cap = np.float32(1 / np.sqrt(d)), np.float32(5.0)
    ours = run_attention(lib.kvc_device_kernel_attention_softcap, q, ks, vs, past, scale, force_prefill, device=device,
                         start=start, cap=cap)
    ref = run_attention(lib.kvc_device_kernel_attention_softcap, q, ks, vs, past, scale, 0, device="cpu", start=start,
                        cap=cap)
    plain = run_attention(lib.kvc_device_kernel_attention, q, ks, vs, past, scale, 0, device="cpu", start=start)
    assert rel(plain, ref) > 0.05  # the cap changes the output: a kernel ignoring it would fail below
    assert rel(ours, ref) < 1.5e-2  # as test_attention_ragged: bf16 probabilities and output of the same sums


@pytest.mark.parametrize("arch,window,first", [("qwen3", None, 0), ("mistral", 6, 0), ("qwen3", 9, 2)])
def test_qwen3_and_window_models_match_cpu(tmp_path, rng, device, arch, window, first):
    """Prefill, then decode steps replayed as graphs, on the device against the CPU."""
    from hf_models import write_tiny_model

    seed = int(rng.integers(1 << 31))
    path = write_tiny_model(str(tmp_path / arch), arch=arch, seed=seed, window=window, window_layers=first)
    cpu = kvpress_c.load_model(path)
    emu = kvpress_c.load_model(path, device=device)
    ids = rng.integers(3, cpu.config["vocab"], size=40).astype(np.int32)
    sc, se = cpu.new_session(), emu.new_session()
    se.set_decode_graphs(True)
    rows_c, rows_e = [sc.forward(ids[:20], logits="all")], [se.forward(ids[:20], logits="all")]
    for t in ids[20:]:
        rows_c.append(sc.forward(np.array([t], np.int32))[None])
        rows_e.append(se.forward(np.array([t], np.int32))[None])
    assert se.graph_info["graph_steps"] == 19, se.graph_info  # the first step eager, every later one replayed
    err = rel(np.concatenate(rows_e), np.concatenate(rows_c))
    print(f"{arch} window={window}: {device} vs cpu {err:.3e} (seed {seed})")
    assert err < MODEL_TOL
