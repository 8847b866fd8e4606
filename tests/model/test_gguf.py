"""GGUF: dequantisation against float64 references written from the ggml block layouts (and against
gguf-py), config reading through the C ABI, weights reaching the forward, and bad files (truncated,
bit-flipped, lying) that must fail with a clear message and never crash."""
import ctypes as C
import os
import struct
import sys
import time

import numpy as np
import pytest

import kvpress_c

import gguf_writer as gw
from gguf_writer import GGML, GGUFFile, random_blocks, tiny_model

from capi import ERR_ARG, ERR_FORMAT, ERR_IO, ERR_UNSUPPORTED, OK, Config, last_error, lib  # noqa: E402

SUPPORTED = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def load(path):
    """kvc_model_load -> (status, Config or None, message)."""
    m = C.c_void_p()
    st = lib.kvc_model_load(str(path).encode(), C.byref(m))
    if st != OK:
        assert not m.value, "a failed load must not hand out a model"
        return st, None, last_error()
    cfg = Config()
    assert lib.kvc_model_get_config(m, C.byref(cfg)) == OK
    lib.kvc_model_free(m)
    return st, cfg, ""


def fresh_rng():
    """Fresh randomness each run; the seed goes into assertion messages."""
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, np.random.default_rng(seed)


def dequant(type_name_or_id, raw: bytes, n: int):
    t = GGML[type_name_or_id][0] if isinstance(type_name_or_id, str) else type_name_or_id
    out = np.full(n, np.nan, dtype=np.float32)
    buf = np.frombuffer(raw, dtype=np.uint8) if raw else np.zeros(1, dtype=np.uint8)
    st = lib.kvc_kernel_dequantize(t, buf.ctypes.data, len(raw), out.ctypes.data, n)
    return st, out


# -- float64 references, written from the ggml block layouts ------------------------------------

def ref_dequant(t: str, raw: bytes):
    """Values (float64) and a per-value magnitude (sum of |terms|) that bounds fp32 rounding."""
    with np.errstate(invalid="ignore", over="ignore"):
        v, mag = _ref_dequant(t, raw)
    return np.asarray(v, dtype=np.float64).reshape(-1), np.asarray(mag, dtype=np.float64).reshape(-1)


def _ref_dequant(t: str, raw: bytes):
    if t == "F32":
        v = np.frombuffer(raw, "<f4").astype(np.float64)
        return v, np.abs(v)
    if t == "F16":
        v = np.frombuffer(raw, "<f2").astype(np.float64)
        return v, np.abs(v)
    if t == "BF16":
        v = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return v, np.abs(v)
    _, be, bb = GGML[t]
    B = np.frombuffer(raw, np.uint8).reshape(-1, bb).astype(np.int64)
    raw8 = np.frombuffer(raw, np.uint8).reshape(-1, bb)

    def f16(off):  # fp16 field at byte `off` of every block -> column
        return raw8[:, off:off + 2].copy().view("<f2").astype(np.float64)

    e = np.arange(be)

    def nib32(qs):  # 32-value blocks: byte j holds element j (low nibble) and j + 16 (high)
        return (qs[:, e % 16] >> (4 * (e // 16))) & 15

    def bit32(off):  # the u32 of fifth bits: bit e for element e
        qh = raw8[:, off:off + 4].copy().view("<u4").astype(np.int64)
        return (qh >> e) & 1

    if t == "Q4_0":
        v = (nib32(B[:, 2:18]) - 8) * f16(0)
        return v, np.abs(v)
    if t == "Q4_1":
        qd = nib32(B[:, 4:20]) * f16(0)
        return qd + f16(2), np.abs(qd) + np.abs(f16(2))
    if t == "Q5_0":
        v = ((nib32(B[:, 6:22]) | (bit32(2) << 4)) - 16) * f16(0)
        return v, np.abs(v)
    if t == "Q5_1":
        qd = (nib32(B[:, 8:24]) | (bit32(4) << 4)) * f16(0)
        return qd + f16(2), np.abs(qd) + np.abs(f16(2))
    if t == "Q8_0":
        v = raw8[:, 2:34].view(np.int8).astype(np.float64) * f16(0)
        return v, np.abs(v)
    # 256-value super-blocks
    h, s, l, j, g = e // 128, (e % 128) // 32, e % 32, e // 16, e // 32
    if t == "Q2_K":
        sc, qs = B[:, 0:16], B[:, 16:80]
        q = (qs[:, 32 * h + l] >> (2 * s)) & 3
        a, m = f16(80) * (sc[:, j] & 15) * q, f16(82) * (sc[:, j] >> 4)
        return a - m, np.abs(a) + np.abs(m)
    if t == "Q3_K":
        hm, qs, sc = B[:, 0:32], B[:, 32:96], B[:, 96:108]
        lo = (sc[:, j % 8] >> (4 * (j // 8))) & 15
        hi = (sc[:, 8 + j % 4] >> (2 * (j // 4))) & 3
        q = ((qs[:, 32 * h + l] >> (2 * s)) & 3) - 4 * (1 - ((hm[:, l] >> g) & 1))
        v = f16(108) * ((lo | (hi << 4)) - 32) * q
        return v, np.abs(v)
    if t in ("Q4_K", "Q5_K"):
        sb = B[:, 4:16]
        gi = np.arange(8)
        lo_g = np.minimum(gi, 3)
        sc8 = np.where(gi < 4, sb[:, lo_g] & 63, (sb[:, np.minimum(gi + 4, 11)] & 15) | ((sb[:, gi % 4] >> 6) << 4))
        mn8 = np.where(gi < 4, sb[:, lo_g + 4] & 63, (sb[:, np.minimum(gi + 4, 11)] >> 4) | ((sb[:, np.minimum(gi, 7)] >> 6) << 4))
        qs = B[:, 16:144] if t == "Q4_K" else B[:, 48:176]
        q = (qs[:, 32 * (g // 2) + l] >> (4 * (g % 2))) & 15
        if t == "Q5_K":
            q = q | (((B[:, 16:48][:, l] >> g) & 1) << 4)
        a, m = f16(0) * sc8[:, g] * q, f16(2) * mn8[:, g]
        return a - m, np.abs(a) + np.abs(m)
    if t == "Q6_K":
        ql, qh, sc = B[:, 0:128], B[:, 128:192], raw8[:, 192:208].view(np.int8).astype(np.int64)
        n, gg = e // 128, (e % 128) // 32
        lo = (ql[:, 64 * n + 32 * (gg % 2) + l] >> (4 * (gg // 2))) & 15
        hi = (qh[:, 32 * n + l] >> (2 * gg)) & 3
        v = f16(208) * sc[:, j] * ((lo | (hi << 4)) - 32)
        return v, np.abs(v)
    raise ValueError(t)


def random_raw(rng, t: str, n_blocks: int) -> tuple[bytes, int]:
    _, be, _ = GGML[t]
    if t == "F32":
        return rng.standard_normal(n_blocks).astype(np.float32).tobytes(), n_blocks
    if t in ("F16", "BF16"):  # every bit pattern may appear, NaN and infinities included
        return rng.integers(0, 1 << 16, size=n_blocks, dtype=np.uint16).tobytes(), n_blocks
    return random_blocks(rng, t, n_blocks, scale=rng.choice([1e-3, 0.05, 2.0])), n_blocks * be


def assert_matches_reference(t, raw, ours, seed):
    ref, mag = ref_dequant(t, raw)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(ours), nan), f"{t}: NaN positions differ (seed {seed})"
    fin = ~nan
    with np.errstate(invalid="ignore"):
        err = np.abs(ours[fin].astype(np.float64) - ref[fin])
    bound = 2.0 ** -21 * mag[fin]  # a few fp32 roundings of the terms
    ok = (ours[fin] == ref[fin]) | (err <= bound)
    assert ok.all(), f"{t}: {np.count_nonzero(~ok)} values off, worst at {np.argmax(err - bound)} (seed {seed})"


@pytest.mark.parametrize("t", SUPPORTED)
def test_dequantize_random_blocks_against_float64_reference(t):
    seed, rng = fresh_rng()
    for n_blocks in (1, int(rng.integers(2, 40)), int(rng.integers(200, 2000))):
        raw, n = random_raw(rng, t, n_blocks)
        st, out = dequant(t, raw, n)
        assert st == OK, last_error()
        assert_matches_reference(t, raw, out, seed)


def test_dequantize_threaded_path_matches_chunks():
    """Tensors of >= 2^22 values are converted by several threads: same values as converting the
    same bytes in small (single-threaded) pieces."""
    seed, rng = fresh_rng()
    for t in SUPPORTED:
        _, be, bb = GGML[t]
        n_blocks = (1 << 22) // be + int(rng.integers(1, 100))
        raw, n = random_raw(rng, t, n_blocks)
        st, whole = dequant(t, raw, n)
        assert st == OK, last_error()
        step = 1 << 18  # values per piece, a multiple of every block size
        for i in range(0, n, step):
            m = min(step, n - i)
            st, part = dequant(t, raw[i // be * bb:(i + m) // be * bb], m)
            assert st == OK and np.array_equal(whole[i:i + m], part, equal_nan=True), f"{t} at {i} (seed {seed})"


@pytest.mark.parametrize("t", [t for t in SUPPORTED if t not in ("F32",)])
def test_dequantize_matches_gguf_py_exactly(t):
    gguf = pytest.importorskip("gguf")
    seed, rng = fresh_rng()
    raw, n = random_raw(rng, t, 64)
    st, out = dequant(t, raw, n)
    assert st == OK, last_error()
    qt = gguf.GGMLQuantizationType[t]
    if t == "F16":
        ref = np.frombuffer(raw, np.float16).astype(np.float32)
    elif t == "BF16":
        ref = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        ref = gguf.quants.dequantize(np.frombuffer(raw, np.uint8).reshape(-1, GGML[t][2]), qt).reshape(-1)
    # bit-exact: both compute the same fp32 products and sums in the same order
    np.testing.assert_array_equal(out, ref.astype(np.float32), err_msg=f"{t} (seed {seed})")


def test_f16_all_bit_patterns():
    h = np.arange(1 << 16, dtype=np.uint16)
    st, out = dequant("F16", h.tobytes(), h.size)
    assert st == OK
    ref = h.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan].view(np.uint32), ref[~nan].view(np.uint32))  # signed zeros, subnormals


def test_block_sizes_and_type_names_match_gguf_py():
    """Every ggml type gguf-py knows: known block size (a wrong byte count is an argument error),
    and either decoded or refused as unsupported by name."""
    gguf = pytest.importorskip("gguf")
    for qt, (be, bb) in gguf.constants.GGML_QUANT_SIZES.items():
        buf = bytes(bb + 1)
        st, _ = dequant(int(qt), buf, be)
        if st == ERR_UNSUPPORTED and "unknown" in last_error():
            assert int(qt) > 30, f"{qt.name} should be known"  # only types newer than this reader
            continue
        assert st == ERR_ARG and f"need {bb} bytes" in last_error(), (qt.name, last_error())
        st, out = dequant(int(qt), buf[:bb], be)
        if qt.name in SUPPORTED:
            assert st == OK, (qt.name, last_error())
        else:
            assert st == ERR_UNSUPPORTED and qt.name in last_error(), (qt.name, st, last_error())


def test_dequantize_argument_checks():
    out = np.zeros(64, dtype=np.float32)
    buf = np.zeros(64, dtype=np.uint8)
    assert lib.kvc_kernel_dequantize(3, buf.ctypes.data, 19, out.ctypes.data, 32) == ERR_ARG  # wrong byte count
    assert "20 bytes" in last_error()
    assert lib.kvc_kernel_dequantize(3, buf.ctypes.data, 20, out.ctypes.data, 31) == ERR_FORMAT  # not whole blocks
    assert "whole number" in last_error()
    assert lib.kvc_kernel_dequantize(3, buf.ctypes.data, 20, out.ctypes.data, -32) == ERR_ARG
    assert lib.kvc_kernel_dequantize(3, None, 20, out.ctypes.data, 32) == ERR_ARG
    assert lib.kvc_kernel_dequantize(3, buf.ctypes.data, 20, None, 32) == ERR_ARG
    assert lib.kvc_kernel_dequantize(99, buf.ctypes.data, 20, out.ctypes.data, 32) == ERR_UNSUPPORTED
    assert lib.kvc_kernel_dequantize(0, None, 0, None, 0) == OK  # nothing to do


@pytest.fixture(scope="module")
def default_index(default_gguf):
    """Metadata and tensor locations of the default model, read by gguf_writer.read_gguf (pure
    Python, independent of the C parser; gguf-py's GGUFReader takes several seconds on it)."""
    return gw.read_gguf(default_gguf)


def test_dequantize_matches_gguf_py_on_default_model(default_gguf, default_index):
    gguf = pytest.importorskip("gguf")
    _, tensors = default_index
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.attn_v.weight", "blk.0.attn_norm.weight"]
    seen = set()
    with open(default_gguf, "rb") as fh:
        for name in names:
            t, ne, off, nbytes = tensors[name]
            if name == "token_embd.weight":  # its first 2048 rows keep the NumPy reference quick
                nbytes, ne = nbytes * 2048 // ne[1], [ne[0], 2048]
            fh.seek(off)
            raw = fh.read(nbytes)
            qt = gguf.GGMLQuantizationType(t)
            seen.add(qt.name)
            n = int(np.prod(ne))
            st, ours = dequant(t, raw, n)
            assert st == OK, last_error()
            blocks = np.frombuffer(raw, np.uint8) if qt.name != "F32" else np.frombuffer(raw, np.float32)
            if qt.name != "F32":
                blocks = blocks.reshape(-1, GGML[qt.name][2])
            ref = gguf.quants.dequantize(blocks, qt).reshape(-1)
            np.testing.assert_array_equal(ours, ref.astype(np.float32), err_msg=name)
    assert {"Q8_0", "Q4_1", "F32"} <= seen, seen


# -- config through the C ABI ---------------------------------------------------------------------

def test_default_model_config_through_ctypes(default_gguf, default_index):
    meta, _ = default_index
    t0 = time.perf_counter()
    st, c, msg = load(default_gguf)
    dt = time.perf_counter() - t0
    assert st == OK, msg
    assert (c.arch, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn, c.vocab) == (0, 30, 576, 9, 3, 64, 1536, 49152)
    assert c.rope_pairing == 1 and c.tied_embeddings == 1 and c.qkv_bias == 0 and c.rope_scaling_factor == 0
    assert c.max_context == meta["llama.context_length"]
    assert c.rope_theta == np.float32(meta["llama.rope.freq_base"])
    assert c.rms_eps == np.float32(meta["llama.attention.layer_norm_rms_epsilon"])
    assert (c.bos_id, c.eos_id) == (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"])
    print(f"default model loaded through ctypes in {dt:.2f} s")


def test_default_model_config_through_python(default_model):
    c = default_model.config
    assert (c["arch"], c["n_layers"], c["hidden"], c["n_heads"], c["n_kv_heads"], c["head_dim"], c["ffn"], c["vocab"]) == \
        ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert c["rope_pairing"] == "adjacent" and c["tied_embeddings"] and c["rope_theta"] == 100000.0
    meta = default_model.metadata()
    assert meta["general.architecture"] == "llama" and len(meta["tokenizer.ggml.tokens"]) == 49152


QUANT_TYPES = {"attn_q": "Q8_0", "attn_k": "F16", "attn_v": "BF16", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
               "ffn_up": "Q5_0", "ffn_down": "Q5_1", "token_embd": "Q8_0", "output": "F16"}
KQUANT_TYPES = {"attn_q": "Q2_K", "attn_k": "Q3_K", "attn_v": "Q4_K", "attn_output": "Q5_K", "ffn_gate": "Q6_K",
                "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"}
VARIANTS = {
    # name: (tiny_model kwargs, expected config fields)
    "llama_f32_tied": ({}, {}),
    "llama_quant_untied": ({"types": QUANT_TYPES, "tied": False}, {"tied_embeddings": 0}),
    "llama_kquants": ({"types": KQUANT_TYPES, "hidden": 256, "ffn": 256, "heads": 4, "kv_heads": 2},
                      {"hidden": 256, "ffn": 256, "head_dim": 64}),
    "qwen2_bias": ({"arch": "qwen2", "bias": True, "types": {"attn_q": "Q8_0", "ffn_up": "Q4_0"}},
                   {"arch": 2, "rope_pairing": 0, "qkv_bias": 1}),
    "mistral": ({"arch": "mistral"}, {"arch": 1}),
    "qwen3_qk_norm": ({"arch": "qwen3", "types": {"attn_q": "Q8_0"}}, {"arch": 3, "rope_pairing": 0, "qk_norm": 1}),
    "qwen3_window": ({"arch": "qwen3", "meta": {"attention.sliding_window": (gw.U32, 24)}},
                     {"arch": 3, "rope_pairing": 0, "qk_norm": 1, "sliding_window": 24, "window_first_layer": 0}),
    "rope_freqs": ({"rope_freqs": [1.0, 2.0, 4.0, 8.0]}, {}),
    "gguf_v2": ({"version": 2}, {}),
    "alignment_64": ({"alignment": 64, "types": {"attn_q": "Q8_0"}}, {}),
    "defaults": ({"kv_heads": 4, "skip_meta": ("attention.head_count_kv", "rope.freq_base", "rope.dimension_count",
                                               "vocab_size", "context_length", "attention.layer_norm_rms_epsilon")},
                 {"n_kv_heads": 4, "max_context": 0}),
    "vocab_from_embedding": ({"tokens": False, "skip_meta": ("vocab_size",), "vocab": 48}, {"vocab": 48, "bos_id": -1, "eos_id": -1}),
    "key_length": ({"head_dim": 16, "meta": {"attention.key_length": (gw.U32, 16), "attention.value_length": (gw.U32, 16)}},
                   {"head_dim": 16}),
    "theta_eps": ({"meta": {"rope.freq_base": (gw.F32, 500000.0), "attention.layer_norm_rms_epsilon": (gw.F32, 1e-6),
                            "context_length": (gw.U64, 4096)}}, {"rope_theta": 500000.0, "rms_eps": np.float32(1e-6), "max_context": 4096}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_gguf_config(tmp_path, variant):
    kw, expect = VARIANTS[variant]
    path = tmp_path / "m.gguf"
    tiny_model(**kw).write(str(path))
    st, c, msg = load(path)
    assert st == OK, f"{variant}: {msg}"
    want = {"arch": 0, "n_layers": 2, "hidden": 32, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "ffn": 64, "vocab": 64,
            "max_context": 256, "rope_pairing": 1, "tied_embeddings": 1, "qkv_bias": 0, "rope_theta": 10000.0,
            "rms_eps": np.float32(1e-5), "rope_scaling_factor": 0.0, "bos_id": 1, "eos_id": 2, "qk_norm": 0,
            "sliding_window": 0}
    want.update(expect)
    got = {k: getattr(c, k) for k in want}
    assert got == want, variant


# -- the weights that reach the forward -----------------------------------------------------------

def f32_twin(kw, tmp_path, name):
    """The model of tiny_model(**kw) and the same model with every tensor stored as the float32
    values of the float64 reference dequantisation: both must give identical logits."""
    weights = {}
    g = tiny_model(weights=weights, **kw)
    g.write(str(tmp_path / f"{name}_q.gguf"))
    twin = GGUFFile(version=g.version, alignment=g.alignment)
    twin.kv = g.kv
    for tname, (t, ne, data) in weights.items():
        vals, _ = ref_dequant(t, data)
        twin.tensor(tname, ne, 0, vals.astype(np.float32).tobytes())
    for t in g.tensors:
        if t[0] not in weights:  # rope_freqs
            twin.tensor(*t)
    twin.write(str(tmp_path / f"{name}_f32.gguf"))
    return str(tmp_path / f"{name}_q.gguf"), str(tmp_path / f"{name}_f32.gguf")


@pytest.mark.parametrize("variant", ["llama_quant_untied", "llama_kquants", "qwen2_bias"])
def test_dequantised_weights_reach_the_forward(tmp_path, variant):
    qpath, fpath = f32_twin(VARIANTS[variant][0], tmp_path, variant)
    ids = [1, 5, 9, 3, 7, 2]
    a = kvpress_c.load_model(qpath, weights="fp32").logits(ids)  # native weights: tests/model/test_native_weights.py
    b = kvpress_c.load_model(fpath).logits(ids)
    assert np.all(np.isfinite(a))
    np.testing.assert_array_equal(a, b)


def test_rope_freqs_and_linear_scaling_reach_the_forward(tmp_path):
    ids = [1, 5, 9, 3, 7, 2, 11, 4]

    def logits(**kw):
        p = tmp_path / f"m{len(os.listdir(tmp_path))}.gguf"
        tiny_model(seed=7, **kw).write(str(p))
        return kvpress_c.load_model(str(p)).logits(ids)

    base = logits()
    np.testing.assert_array_equal(logits(rope_freqs=[1.0] * 4), base)  # divisors of one change nothing
    scaled = logits(rope_freqs=[1.0, 2.0, 4.0, 8.0])
    assert not np.allclose(scaled, base)
    linear = logits(meta={"rope.scaling.type": (gw.STRING, "linear"), "rope.scaling.factor": (gw.F32, 2.0)})
    np.testing.assert_allclose(linear, logits(rope_freqs=[2.0] * 4), rtol=0, atol=0)
    assert not np.allclose(linear, base)


# -- bad files: precise messages ------------------------------------------------------------------

def patch(data: bytes, pos: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, pos, value)
    return bytes(b)


def field(lay, kind, owner=None, nth=0):
    hits = [f for f in lay.fields if f.kind == kind and (owner is None or f.owner == owner)]
    return hits[nth]


def base_file(**kw):
    return tiny_model(types={"attn_q": "Q8_0", "ffn_up": "Q4_1"}, **kw).to_bytes()


def corrupt_cases():
    data, lay = base_file()
    q = "blk.0.attn_q.weight"
    cases = {
        "bad magic": (b"GGML" + data[4:], ERR_FORMAT, "not a GGUF file"),
        "tiny file": (data[:20], ERR_FORMAT, "too few"),
        "v1": (patch(data, 4, "<I", 1), ERR_UNSUPPORTED, "v1"),
        "v9": (patch(data, 4, "<I", 9), ERR_FORMAT, "unknown version 9"),
        "big-endian": (patch(data, 4, "<I", 3 << 24), ERR_UNSUPPORTED, "big-endian"),
        "lying n_tensors": (patch(data, 8, "<Q", 1 << 40), ERR_FORMAT, "claims"),
        "lying n_kv": (patch(data, 16, "<Q", 2 ** 64 - 1), ERR_FORMAT, "claims"),
        "one tensor too many": (patch(data, 8, "<Q", len(tiny_model().tensors) + 1), ERR_FORMAT, "re-download"),
        "lying key length": (patch(data, field(lay, "key_len").pos, "<Q", 1 << 50), ERR_FORMAT, "claims"),
        "zero key length": (patch(data, field(lay, "key_len").pos, "<Q", 0), ERR_FORMAT, "length 0"),
        "lying string length": (patch(data, field(lay, "str_len", "general.architecture").pos, "<Q", 1 << 33), ERR_FORMAT,
                                "general.architecture"),
        "lying array length": (patch(data, field(lay, "array_len", "tokenizer.ggml.tokens").pos, "<Q", 1 << 61), ERR_FORMAT,
                               "tokenizer.ggml.tokens"),
        "unknown value type": (patch(data, field(lay, "value_type", "llama.block_count").pos, "<I", 13), ERR_FORMAT,
                               "unknown value type 13"),
        "unknown array type": (patch(data, field(lay, "array_type", "tokenizer.ggml.tokens").pos, "<I", 77), ERR_FORMAT,
                               "unknown value type 77"),
        "array of arrays": (patch(data, field(lay, "array_type", "tokenizer.ggml.tokens").pos, "<I", 9), ERR_UNSUPPORTED,
                            "array of arrays"),
        "n_dims 0": (patch(data, field(lay, "n_dims", q).pos, "<I", 0), ERR_FORMAT, "0 dimensions"),
        "n_dims 5": (patch(data, field(lay, "n_dims", q).pos, "<I", 5), ERR_FORMAT, "5 dimensions"),
        "huge dim": (patch(data, field(lay, "ne", q).pos, "<Q", 2 ** 63), ERR_FORMAT, "impossible shape"),
        "dims overflow": (patch(patch(data, field(lay, "ne", q).pos, "<Q", 2 ** 40), field(lay, "ne", q, 1).pos, "<Q", 2 ** 40),
                          ERR_FORMAT, "impossible shape"),
        "row not whole blocks": (patch(data, field(lay, "ne", q).pos, "<Q", 33), ERR_FORMAT, "whole number of Q8_0 blocks"),
        "data past the end": (patch(data, field(lay, "ne", q, 1).pos, "<Q", 1 << 20), ERR_FORMAT, "past the end"),
        "invalid type id": (patch(data, field(lay, "ggml_type", q).pos, "<I", 200), ERR_FORMAT, "invalid ggml type id 200"),
        "unknown type id": (patch(data, field(lay, "ggml_type", q).pos, "<I", 60), ERR_UNSUPPORTED, "type id 60"),
        "unsupported type": (patch(data, field(lay, "ggml_type", q).pos, "<I", 16), ERR_FORMAT, "IQ2_XXS"),
        "misaligned offset": (patch(data, field(lay, "offset", q).pos, "<Q", 8), ERR_FORMAT, "not a multiple of the alignment"),
        "offset past the end": (patch(data, field(lay, "offset", q).pos, "<Q", 1 << 40), ERR_FORMAT, q),
        "truncated data": (data[: len(data) - 100], ERR_FORMAT, "past the end"),
        "truncated metadata": (data[: field(lay, "n_dims", q).pos - 40], ERR_FORMAT, "runs past the end"),
    }
    return cases


def test_corrupt_files_fail_with_precise_messages(tmp_path):
    cases = corrupt_cases()
    for name, (blob, want_st, want_msg) in cases.items():
        p = tmp_path / "bad.gguf"
        p.write_bytes(blob)
        st, _, msg = load(p)
        assert (st, want_msg in msg) == (want_st, True), f"{name}: status {st}, message {msg!r}"
        if st == ERR_FORMAT and name not in ("bad magic", "unsupported type"):
            assert "re-download" in msg or "corrupt" in msg, f"{name}: no hint in {msg!r}"


def test_crafted_files_fail_with_precise_messages(tmp_path):
    def expect(g, want_st, want_msg):
        p = tmp_path / "c.gguf"
        g.write(str(p))
        st, _, msg = load(p)
        assert st == want_st and want_msg in msg, (want_st, want_msg, st, msg)

    g = tiny_model()
    g.u32("llama.block_count", 2)  # a second copy of the key
    expect(g, ERR_FORMAT, "duplicate metadata key 'llama.block_count'")
    g = tiny_model()
    g.tensors.append(g.tensors[3])
    expect(g, ERR_FORMAT, "duplicate tensor 'blk.0.attn_q.weight'")
    expect(tiny_model(alignment=48), ERR_FORMAT, "power of two")
    g = tiny_model()
    g.f32("general.alignment", 32.0)
    expect(g, ERR_FORMAT, "general.alignment must be an unsigned integer")
    expect(tiny_model(arch="gpt2"), ERR_UNSUPPORTED, "'gpt2' is not supported")
    g = tiny_model()
    g.kv = [kv for kv in g.kv if kv[0] != "general.architecture"]
    expect(g, ERR_FORMAT, "general.architecture is missing")
    g = tiny_model()
    g.kv[0] = ("general.architecture", gw.U32, 7, None)
    expect(g, ERR_FORMAT, "'general.architecture' should be a single string")
    expect(tiny_model(skip_meta=("block_count",)), ERR_FORMAT, "'llama.block_count' is missing")
    expect(tiny_model(meta={"block_count": (gw.STRING, "two")}), ERR_FORMAT, "'llama.block_count' is a string, not a number")
    expect(tiny_model(meta={"block_count": (gw.F32, 2.5)}), ERR_FORMAT, "not an integer")
    expect(tiny_model(meta={"block_count": (gw.U64, 2 ** 40)}), ERR_FORMAT, "out of range")
    expect(tiny_model(meta={"block_count": (gw.U32, 3)}), ERR_FORMAT, "'blk.2.attn_norm.weight' is missing")
    expect(tiny_model(meta={"embedding_length": (gw.U32, 40)}), ERR_FORMAT, "tensor 'token_embd.weight' has shape [32, 64], expected [40, 64]")
    expect(tiny_model(meta={"feed_forward_length": (gw.U32, 32)}), ERR_FORMAT, "'blk.0.ffn_gate.weight' has shape [32, 64], expected [32, 32]")
    expect(tiny_model(meta={"attention.head_count_kv": (gw.U32, 4)}), ERR_FORMAT, "'blk.0.attn_k.weight' has shape [32, 16], expected [32, 32]")
    expect(tiny_model(meta={"vocab_size": (gw.U32, 65)}), ERR_FORMAT, "'token_embd.weight'")
    # mixture of experts: Mixtral as llama.cpp writes it ('llama' + expert_count) needs its per-token count; other
    # families' experts are refused by name
    expect(tiny_model(meta={"expert_count": (gw.U32, 8)}), ERR_FORMAT, "'llama.expert_used_count' is missing")
    expect(tiny_model(arch="qwen2", meta={"expert_count": (gw.U32, 8)}), ERR_UNSUPPORTED, "mixture-of-experts 'qwen2' models")
    expect(tiny_model(meta={"rope.dimension_count": (gw.U32, 4), "attention.key_length": (gw.U32, 8)}), ERR_UNSUPPORTED,
           "partial rotary")
    expect(tiny_model(meta={"rope.scaling.type": (gw.STRING, "yarn"), "rope.scaling.factor": (gw.F32, 4.0)}),
           ERR_UNSUPPORTED, "RoPE scaling 'yarn'")
    expect(tiny_model(meta={"attention.head_count": (gw.U32, 0)}), ERR_FORMAT, "head_count = 0")
    g = tiny_model(rope_freqs=[1.0, -2.0, 1.0, 1.0])
    expect(g, ERR_FORMAT, "rope_freqs")
    expect(tiny_model(rope_freqs=[1.0, 2.0]), ERR_FORMAT, "'rope_freqs.weight' has shape [2], expected [4]")
    g = tiny_model(bias=True)
    g.tensors = [t for t in g.tensors if t[0] != "blk.1.attn_k.bias"]
    expect(g, ERR_FORMAT, "'blk.1.attn_k.bias' is missing")
    g = tiny_model()
    g.add_array("blk.0.attn_output.bias", np.zeros(32, np.float32))
    expect(g, ERR_UNSUPPORTED, "blk.0.attn_output.bias")
    g = tiny_model(types={"attn_q": "Q8_0"})
    i = [t[0] for t in g.tensors].index("blk.0.attn_q.weight")
    name, ne, _, data = g.tensors[i]
    g.tensors[i] = (name, [256, 4], GGML["IQ2_XXS"][0], bytes(4 * 66))
    expect(g, ERR_FORMAT, "blk.0.attn_q.weight' has shape [256, 4]")
    g.tensors[i] = (name, ne, 16, bytes(len(data)))  # right shape but IQ2_XXS needs 256-value rows
    expect(g, ERR_FORMAT, "not a whole number of IQ2_XXS blocks")


def test_unsupported_tensor_type_is_named(tmp_path):
    g = tiny_model(hidden=256, ffn=256, heads=4, types={"attn_q": "IQ2_XXS"})
    g.write(str(tmp_path / "iq.gguf"))
    st, _, msg = load(tmp_path / "iq.gguf")
    assert st == ERR_UNSUPPORTED and "'blk.0.attn_q.weight' is IQ2_XXS" in msg, msg
    # an unneeded tensor of an unsupported type is fine
    g = tiny_model()
    g.tensor("extra.weight", [256], GGML["IQ2_XXS"][0], bytes(66))
    g.write(str(tmp_path / "extra.gguf"))
    assert load(tmp_path / "extra.gguf")[0] == OK


def test_missing_path_is_an_io_error(tmp_path):
    st, _, msg = load(tmp_path / "nope.gguf")
    assert st == ERR_IO and "does not exist" in msg, msg
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    st, _, msg = load(fifo)
    assert st == ERR_IO and "not a regular file" in msg, msg


# -- fuzzing ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen3moe", "mixtral"])
def test_fuzz_corrupt_gguf_never_crashes(tmp_path, family):
    """Corruptions of a small file of each family (support/fuzz.py), lies in its own `{arch}.*` values included:
    llama (Q8_0, Q4_1 and F16 matrices, rope_freqs, alignment 32), qwen3moe and Mixtral as llama.cpp writes it
    ('llama' with expert_count; 3-D expert tensors of Q8_0, a router)."""
    from fuzz import run_gguf_fuzz
    from moe_models import write_random_moe_gguf
    base = str(tmp_path / "base.gguf")
    if family == "llama":
        lay = tiny_model(types={"attn_q": "Q8_0", "ffn_up": "Q4_1", "attn_k": "F16"}, bias=False, tied=False,
                         rope_freqs=[1.0, 1.5, 2.0, 4.0], alignment=32).write(base)
    else:
        shapes = dict(layers=2, hidden=32, heads=2, kv_heads=1, head_dim=16, experts=4, used=2, moe_ffn=32, ffn=64, vocab=64)
        write_random_moe_gguf(base, shapes, types={"attn": "F32", "experts": "Q8_0", "embd": "F32", "output": "F32"},
                              arch="llama" if family == "mixtral" else "qwen3moe")
        lay = gw.gguf_layout(base)
    assert load(base)[0] == OK
    seed = fresh_rng()[0]
    t0 = time.perf_counter()
    out = run_gguf_fuzz(tmp_path, base, lay, seed, n=1000, arch="llama" if family == "mixtral" else family)
    print(out, f"in {time.perf_counter() - t0:.1f} s")


# -- the Python API -------------------------------------------------------------------------------

def test_corrupt_gguf_raises_python_errors(tmp_path):
    data, lay = base_file()
    cases = {"truncated": (data[: len(data) // 2], ValueError, "truncated"),
             "header-only": (data[:100], ValueError, "truncated"),
             "bad-version": (patch(data, 4, "<I", 99), ValueError, "unknown version 99"),
             "v1": (patch(data, 4, "<I", 1), NotImplementedError, "v1"),
             "huge-count": (patch(data, 8, "<Q", 2 ** 62), ValueError, "claims"),
             "not-gguf": (b"this is not a model file at all, just some text", ValueError, "not a GGUF file")}
    for name, (blob, exc, text) in cases.items():
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(blob)
        with pytest.raises(exc) as e:
            kvpress_c.load_model(str(p))
        assert text in str(e.value), (name, str(e.value))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        kvpress_c.load_model(str(tmp_path / "nope.gguf"))


def test_out_of_vocabulary_tokens_raise(default_model):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        default_model.logits([1, 2, 49152])
    with pytest.raises(ValueError):
        default_model.logits([-1])
    with pytest.raises(ValueError):
        default_model.logits([])
    s = default_model.new_session()
    with pytest.raises(ValueError):
        s.forward(np.array([[1, 2]]))
    # the session is still usable after a rejected call
    assert s.forward(np.array([1, 2, 3], dtype=np.int32)).shape == (49152,)
