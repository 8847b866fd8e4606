"""Hugging Face folders (csrc/model/hf_model.c, safetensors.c, json.c): every tiny model variant
through the C ABI, RoPE scaling against transformers' formula, config.json validation, shards and
index files, hand-written safetensors headers, JSON edge cases, and a fuzzer (in a subprocess) that
feeds hundreds of corrupt files and configs which must be rejected with a message, never crash."""
import ctypes as C
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvpress_c
from kvpress_c._paths import core_library_path

pytest.importorskip("torch")
pytest.importorskip("transformers")
from hf_models import ARCHS, LLAMA3_SCALING, write_tiny_model  # noqa: E402

ARCH_ID = {"llama": 0, "llama31": 0, "mistral": 1, "qwen2": 2, "qwen3": 3}
from capi import ERR_FORMAT as ST_FORMAT, ERR_IO as ST_IO  # noqa: E402
from capi import ERR_UNSUPPORTED as ST_UNSUPPORTED, OK as ST_OK, Config, lib  # noqa: E402


def c_load(path):
    """(status, message, config or None, format, weight bytes) through the C ABI."""
    m = C.c_void_p()
    st = lib.kvc_model_load(os.fspath(path).encode(), C.byref(m))
    if st != ST_OK:
        assert not m.value, "a failed load returned a model"
        return st, lib.kvc_last_error().decode(), None, None, 0
    try:
        cfg = Config()
        assert lib.kvc_model_get_config(m, C.byref(cfg)) == ST_OK
        return st, "", cfg, lib.kvc_model_format(m).decode(), lib.kvc_model_weight_bytes(m)
    finally:
        lib.kvc_model_free(m)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(arch, dtype, tied, sharded) -> a cached folder (do not modify it: use clone())."""
    root = tmp_path_factory.mktemp("hf")
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"tiny model seed = {seed}")
    cache = {}

    def get(arch="llama", dtype="float32", tied=False, sharded=False):
        key = (arch, dtype, tied, sharded)
        if key not in cache:
            cache[key] = write_tiny_model(str(root / "_".join(map(str, key))), arch=arch, dtype=dtype, tied=tied,
                                          sharded=sharded, seed=seed)
        return cache[key]

    get.seed = seed
    return get


def clone(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def read_cfg(d):
    with open(os.path.join(d, "config.json")) as f:
        return json.load(f)


def write_cfg(d, cfg=None, text=None):
    with open(os.path.join(d, "config.json"), "w" if text is None or isinstance(text, str) else "wb") as f:
        f.write(json.dumps(cfg) if text is None else text)


def edit_cfg(d, **changes):
    """`key=...` (Ellipsis) deletes the key."""
    cfg = read_cfg(d)
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    write_cfg(d, cfg)
    return d


def st_read(path):
    """(header dict, data bytes) of a safetensors file."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def st_pack(header, data):
    text = header if isinstance(header, (str, bytes)) else json.dumps(header)
    text = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(text)) + text + data


def st_rewrite(d, edit, name="model.safetensors"):
    """Apply edit(header, data) -> (header or header text, data) to a file of folder d."""
    path = os.path.join(d, name)
    hdr, data = st_read(path)
    hdr, data = edit(hdr, data)
    with open(path, "wb") as f:
        f.write(st_pack(hdr, data))
    return d


# ------------------------------------------------------------------------------------------------
# every variant through the C ABI

VARIANTS = [(a, dt, False, False) for a in ARCHS for dt in ("float32", "float16", "bfloat16")] + \
           [("llama", "float32", True, False), ("mistral", "bfloat16", False, True), ("qwen2", "float16", True, True),
            ("llama31", "float32", False, True)]


@pytest.mark.parametrize("arch,dtype,tied,sharded", VARIANTS)
def test_variants_load_through_ctypes(tiny, arch, dtype, tied, sharded):
    path = tiny(arch, dtype, tied, sharded)
    files = os.listdir(path)
    assert ("model.safetensors.index.json" in files) == sharded
    if sharded:
        assert sum(f.endswith(".safetensors") for f in files) >= 2, files
    st, msg, cfg, fmt, nbytes = c_load(path)
    assert st == ST_OK, msg
    assert fmt == "safetensors"
    assert (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn, cfg.vocab) == (4, 64, 4, 2, 16, 128, 256)
    assert cfg.arch == ARCH_ID[arch] and cfg.rope_pairing == 0  # KVC_ROPE_HALF
    assert cfg.qkv_bias == (arch == "qwen2") and cfg.tied_embeddings == tied and cfg.qk_norm == (arch == "qwen3")
    assert cfg.sliding_window == 0
    assert cfg.max_context == 2048 and cfg.bos_id == 1 and cfg.eos_id == 2
    assert cfg.rms_eps == np.float32(1e-5) and cfg.rope_theta == 10000.0
    if arch == "llama31":
        assert (cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_context) == \
               (8.0, 1.0, 4.0, 64)
    else:
        assert cfg.rope_scaling_factor == 0.0
    # native weights: matrices (4 layers of q/k/v/o and 3 MLP, embeddings, lm_head) keep the file's 2 or 4
    # bytes a value; f32 norms (2 per layer + final), biases and rope_inv_freq[d/2]
    D, F, V, qd, kd = 64, 128, 256, 64, 32
    matrix = 4 * (D * qd + 2 * D * kd + qd * D + 3 * D * F) + V * D * (1 if tied else 2)
    vector = 4 * (2 * D + (qd + 2 * kd) * (arch == "qwen2") + 2 * 16 * (arch == "qwen3")) + D + 8  # + q/k norms [d]
    assert nbytes == (2 if dtype in ("float16", "bfloat16") else 4) * matrix + 4 * vector


def logits(path, ids):
    return kvpress_c.load_model(path).logits(ids)


def test_same_weights_in_other_containers_give_identical_logits(tiny, tmp_path, rng):
    """Shards vs one file; 16-bit files vs the same values upcast to float32 by torch; tied vs an
    explicit copy of the embedding as lm_head: the loaded fp32 weights, hence the logits, match exactly."""
    import torch
    from safetensors.torch import load_file, save_file

    ids = rng.integers(0, 256, size=24).tolist()
    for arch in ("llama", "qwen2"):
        np.testing.assert_array_equal(logits(tiny(arch, "float32", False, True), ids), logits(tiny(arch), ids))
    for dtype in ("float16", "bfloat16"):
        src = tiny("mistral", dtype)
        d = clone(src, tmp_path / dtype)
        tensors = load_file(os.path.join(d, "model.safetensors"))
        save_file({k: v.to(torch.float32) for k, v in tensors.items()}, os.path.join(d, "model.safetensors"))
        np.testing.assert_array_equal(logits(src, ids), logits(d, ids))
    src = tiny("qwen2", "float32", True)
    d = clone(src, tmp_path / "untied")
    tensors = load_file(os.path.join(d, "model.safetensors"))
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, os.path.join(d, "model.safetensors"))
    edit_cfg(d, tie_word_embeddings=False)
    assert c_load(d)[2].tied_embeddings == 0
    np.testing.assert_array_equal(logits(src, ids), logits(d, ids))


def test_the_8b_shaped_writer_of_the_gpu_tests_loads_like_hf(tmp_path, rng):
    """random_llama.write_llama31_bf16 (the GPU tests' and benchmarks' Llama-3.1-8B-shaped model, here
    with tiny shapes in 4 shards): kvpress_c loads it, and its logits are HF transformers' on the same
    bf16 weights (llama3 RoPE scaling, untied head), so the GPU parity test compares like with like."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from random_llama import write_llama31_bf16
    shapes = dict(layers=3, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=300, head_dim=16)
    path = write_llama31_bf16(str(tmp_path / "m"), shapes, seed=int(rng.integers(1 << 30)), shard_bytes=24 << 10)
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(shards) >= 4 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    model = kvpress_c.load_model(path)
    assert model.config["n_layers"] == 3 and model.config["vocab"] == 300
    ids = rng.integers(0, 300, size=50)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None])).logits[0].numpy()
    ours = model.logits(ids.astype(np.int32))
    assert np.max(np.abs(ours - ref)) <= 1e-4 * np.max(np.abs(ref))


def test_tied_decision(tiny, tmp_path):
    """Absent tie_word_embeddings: the weights decide; an explicit false needs lm_head.weight."""
    d = edit_cfg(clone(tiny("llama", "float32", True), tmp_path / "a"), tie_word_embeddings=...)
    assert c_load(d)[2].tied_embeddings == 1
    d = edit_cfg(clone(tiny("llama"), tmp_path / "b"), tie_word_embeddings=...)
    assert c_load(d)[2].tied_embeddings == 0
    d = edit_cfg(clone(tiny("llama", "float32", True), tmp_path / "c"), tie_word_embeddings=False)
    with pytest.raises(ValueError, match="lm_head.weight.*tie_word_embeddings"):
        kvpress_c.load_model(d)
    # tied = true wins over a stray lm_head.weight (transformers ties it too)
    d = edit_cfg(clone(tiny("llama"), tmp_path / "d"), tie_word_embeddings=True)
    assert c_load(d)[2].tied_embeddings == 1


# ------------------------------------------------------------------------------------------------
# RoPE

def llama3_inv_freq(theta, head_dim, factor, low, high, orig):
    """transformers' _compute_llama3_parameters, in float64."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv
    low_wl, high_wl = orig / low, orig / high
    scaled = np.where(wavelen > low_wl, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, scaled), wavelen, low_wl, high_wl


def test_llama3_rope_frequencies_of_the_tiny_model(tiny):
    """The config the loader read, through kvc_kernel_rope_freqs, against the float64 formula and
    against transformers' own RoPE initialisation for that config.json."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = tiny("llama31")
    cfg = c_load(path)[2]
    out = np.zeros(cfg.head_dim // 2, dtype=np.float32)
    assert lib.kvc_kernel_rope_freqs(C.byref(cfg), out) == ST_OK
    ref, wl, low_wl, high_wl = llama3_inv_freq(10000.0, 16, **{"factor": 8.0, "low": 1.0, "high": 4.0, "orig": 64})
    assert (wl < high_wl).any() and (wl > low_wl).any() and ((wl >= high_wl) & (wl <= low_wl)).any(), \
        "the tiny model should exercise all three llama3 regimes"
    np.testing.assert_allclose(out, ref, rtol=2e-7)
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    hf_inv, scale = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert scale == 1.0
    np.testing.assert_allclose(out, hf_inv.numpy(), rtol=1e-6)
    unscaled = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    assert not np.allclose(out, unscaled)


def test_llama3_rope_frequencies_random_parameters(rng):
    for _ in range(50):
        head_dim = int(rng.choice([16, 32, 64, 128]))
        theta = float(rng.choice([1e4, 5e5, 1e6])) * float(rng.uniform(0.5, 2))
        low = float(rng.uniform(0.5, 2))
        high = low + float(rng.uniform(0.5, 6))
        factor = float(rng.uniform(1, 32))
        orig = int(rng.integers(16, 16384))
        cfg = Config(head_dim=head_dim, rope_theta=theta, rope_scaling_factor=factor, rope_low_freq_factor=low,
                     rope_high_freq_factor=high, rope_original_context=orig)
        out = np.zeros(head_dim // 2, dtype=np.float32)
        assert lib.kvc_kernel_rope_freqs(C.byref(cfg), out) == ST_OK
        # the reference uses the float32-rounded parameters the C struct holds
        ref = llama3_inv_freq(np.float32(theta).item(), head_dim, np.float32(factor).item(), np.float32(low).item(),
                              np.float32(high).item(), orig)[0]
        np.testing.assert_allclose(out, ref, rtol=2e-6, err_msg=f"{head_dim=} {theta=} {factor=} {low=} {high=} {orig=}")
    cfg = Config(head_dim=64, rope_theta=10000.0)
    out = np.zeros(32, dtype=np.float32)
    assert lib.kvc_kernel_rope_freqs(C.byref(cfg), out) == ST_OK
    np.testing.assert_allclose(out, 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64), rtol=2e-7)


def test_rope_config_spellings(tiny, tmp_path):
    """Older transformers: top-level rope_theta + rope_scaling with "type"; per-layer-type dicts."""
    want = c_load(tiny("llama31"))[2]
    fields = ("rope_theta", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context")
    legacy = dict(LLAMA3_SCALING)
    legacy["type"] = legacy.pop("rope_type")
    variants = {
        "legacy": dict(rope_parameters=..., rope_theta=10000.0, rope_scaling=legacy),
        "both": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_scaling=dict(LLAMA3_SCALING)),
        "per_layer": dict(rope_parameters={"full_attention": dict(LLAMA3_SCALING, rope_theta=10000.0)}),
        "orig_default": dict(rope_parameters=dict(LLAMA3_SCALING, rope_theta=10000.0, original_max_position_embeddings=...)),
    }
    for name, changes in variants.items():
        d = clone(tiny("llama31"), tmp_path / name)
        cfg = read_cfg(d)
        for k, v in changes.items():
            if v is ...:
                cfg.pop(k, None)
            elif isinstance(v, dict):
                cfg[k] = {a: b for a, b in v.items() if b is not ...}
            else:
                cfg[k] = v
        write_cfg(d, cfg)
        st, msg, got, _, _ = c_load(d)
        assert st == ST_OK, f"{name}: {msg}"
        expect = {f: getattr(want, f) for f in fields}
        if name == "orig_default":  # transformers defaults it to max_position_embeddings
            expect["rope_original_context"] = 2048
        assert {f: getattr(got, f) for f in fields} == expect, name
    d = edit_cfg(clone(tiny("llama"), tmp_path / "theta"), rope_parameters=..., rope_theta=500000.0, rope_scaling=None)
    assert c_load(d)[2].rope_theta == 500000.0
    d = edit_cfg(clone(tiny("llama"), tmp_path / "inner"), rope_theta=1.0e6)  # the dict's value wins, as in transformers
    assert c_load(d)[2].rope_theta == 10000.0


def test_longrope_without_its_factors_is_a_format_error(tiny, tmp_path):
    """LongRoPE runs on any architecture (issue 30; tests/model/test_phi3.py), given its factor lists."""
    d = edit_cfg(clone(tiny("llama"), tmp_path / "m"), rope_scaling={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(ValueError, match="short_factor"):
        kvpress_c.load_model(d)


# "linear" runs (every frequency / factor, on any architecture: Gemma 3's full layers; tests/model/test_gemma3.py)
@pytest.mark.parametrize("kind", ["dynamic", "yarn"])
def test_other_rope_scaling_types_are_unsupported(tiny, tmp_path, kind):
    d = edit_cfg(clone(tiny("llama"), tmp_path / "m"), rope_scaling={"rope_type": kind, "factor": 4.0})
    st, msg = c_load(d)[:2]
    assert st == ST_UNSUPPORTED and kind in msg, msg
    with pytest.raises(NotImplementedError, match=kind):
        kvpress_c.load_model(d)


# ------------------------------------------------------------------------------------------------
# config.json values

CONFIG_CASES = [
    ({"model_type": "gpt2"}, NotImplementedError, "model_type 'gpt2' is not supported"),
    ({"model_type": ...}, ValueError, "model_type"),
    ({"model_type": 3}, ValueError, "model_type"),
    ({"num_attention_heads": 3}, ValueError, r"num_attention_heads \(3\) is not a multiple of num_key_value_heads \(2\)"),
    ({"num_key_value_heads": 8}, ValueError, "num_key_value_heads"),
    ({"num_key_value_heads": 0}, ValueError, "num_key_value_heads"),
    ({"hidden_size": -4}, ValueError, "'hidden_size' must be an integer.*got -4"),
    ({"hidden_size": 64.5}, ValueError, "hidden_size"),
    ({"hidden_size": "64"}, ValueError, "hidden_size.*got \"64\""),
    ({"num_hidden_layers": "four"}, ValueError, "num_hidden_layers"),
    ({"num_hidden_layers": 0}, ValueError, "num_hidden_layers"),
    ({"num_hidden_layers": 2**40}, ValueError, "num_hidden_layers"),
    ({"vocab_size": ...}, ValueError, "'vocab_size' is missing"),
    ({"intermediate_size": ...}, ValueError, "'intermediate_size' is missing"),
    ({"hidden_size": ...}, ValueError, "'hidden_size' is missing"),
    ({"intermediate_size": 100}, ValueError, r"mlp.gate_proj.weight' has shape \[128, 64\], but config.json implies \[100, 64\]"),
    ({"vocab_size": 300}, ValueError, r"embed_tokens.weight' has shape \[256, 64\].*\[300, 64\]"),
    ({"head_dim": 15}, ValueError, "head_dim.*even"),
    ({"head_dim": 32}, ValueError, r"q_proj.weight' has shape \[64, 64\].*\[128, 64\]"),
    ({"rms_norm_eps": -1}, ValueError, "rms_norm_eps"),
    ({"rms_norm_eps": 0}, ValueError, "rms_norm_eps"),
    ({"rms_norm_eps": "1e-5"}, ValueError, "rms_norm_eps"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, ValueError, "rope_theta"),
    ({"rope_parameters": "x"}, ValueError, "rope_parameters"),
    ({"rope_scaling": [1]}, ValueError, "rope_scaling"),
    ({"rope_scaling": {"factor": 2.0}}, ValueError, "rope_type"),
    ({"rope_scaling": {"rope_type": 7}}, ValueError, "rope_type"),
    ({"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}}, ValueError, "'factor' is missing"),
    ({"rope_scaling": dict(LLAMA3_SCALING, high_freq_factor=1.0)}, ValueError, "high_freq_factor"),
    ({"rope_scaling": dict(LLAMA3_SCALING, factor=-8.0)}, ValueError, "factor"),
    ({"tie_word_embeddings": "yes"}, ValueError, "tie_word_embeddings"),
    ({"bos_token_id": 999}, ValueError, "bos_token_id"),
    ({"eos_token_id": [2, 999]}, ValueError, "eos_token_id"),
    ({"eos_token_id": "x"}, ValueError, "eos_token_id"),
    ({"hidden_act": "gelu"}, NotImplementedError, "hidden_act 'gelu'"),
    ({"attention_bias": True}, NotImplementedError, "attention_bias"),
    ({"mlp_bias": True}, NotImplementedError, "mlp_bias"),
    ({"sliding_window": -1}, ValueError, "sliding_window"),
    ({"max_position_embeddings": 0}, ValueError, "max_position_embeddings"),
]


@pytest.mark.parametrize("changes,exc,match", CONFIG_CASES, ids=[str(c[0])[:60] for c in CONFIG_CASES])
def test_bad_config_values(tiny, tmp_path, changes, exc, match):
    d = edit_cfg(clone(tiny("llama"), tmp_path / "m"), **changes)
    with pytest.raises(exc, match=match):
        kvpress_c.load_model(d)
    st, msg = c_load(d)[:2]
    assert st == {ValueError: ST_FORMAT, NotImplementedError: ST_UNSUPPORTED}[exc], msg
    assert "config.json" in msg, msg


@pytest.mark.parametrize("changes,check", [
    ({"eos_token_id": [2, 5]}, lambda c: c.eos_id == 2),
    ({"eos_token_id": None, "bos_token_id": None}, lambda c: c.eos_id == -1 and c.bos_id == -1),
    ({"num_key_value_heads": None}, None),  # defaults to the head count: the k_proj shape then says no
    ({"head_dim": None}, lambda c: c.head_dim == 16),
    ({"head_dim": ..., "max_position_embeddings": ..., "rms_norm_eps": ...},
     lambda c: c.head_dim == 16 and c.max_context == 2048 and c.rms_eps == np.float32(1e-6)),
    ({"sliding_window": 4096, "use_sliding_window": True}, lambda c: c.arch == 0),
    ({"hidden_size": 64.0, "vocab_size": 2.56e2}, lambda c: c.hidden == 64 and c.vocab == 256),
    ({"hidden_act": "swish", "attention_bias": False, "mlp_bias": None}, lambda c: True),
    ({"unknown_future_key": {"nested": [1, {"x": None}]}}, lambda c: True),
])
def test_accepted_config_variants(tiny, tmp_path, changes, check):
    d = edit_cfg(clone(tiny("llama"), tmp_path / "m"), **changes)
    st, msg, cfg = c_load(d)[:3]
    if check is None:
        assert st == ST_FORMAT and "k_proj" in msg, msg
    else:
        assert st == ST_OK, msg
        assert check(cfg)


# (model_type, config changes) -> (sliding_window, window_first_layer) as transformers reads them
WINDOW_CONFIGS = [
    ("mistral", dict(sliding_window=32), (32, 0)),
    ("mistral", dict(sliding_window=None), (0, 0)),
    ("mistral", dict(sliding_window=...), (4096, 0)),  # MistralConfig's default
    ("qwen2", dict(sliding_window=32), (0, 0)),  # without use_sliding_window: none
    ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=2, layer_types=...), (32, 2)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=2), (0, 0)),  # layer_types win
    ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=4, layer_types=...), (0, 0)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=..., max_window_layers=..., layer_types=...), (0, 0)),  # 28
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1,
                   layer_types=["full_attention", "full_attention", "sliding_attention", "sliding_attention"]), (16, 2)),
    ("llama", dict(sliding_window=32), (0, 0)),  # transformers' llama has no window
]


@pytest.mark.parametrize("arch,changes,expect", WINDOW_CONFIGS)
def test_sliding_window_configs(tiny, tmp_path, arch, changes, expect):
    d = edit_cfg(clone(tiny(arch), tmp_path / "m"), **changes)
    st, msg, cfg = c_load(d)[:3]
    assert st == ST_OK, msg
    assert (cfg.sliding_window, cfg.window_first_layer) == expect


def test_sliding_window_layer_pattern_the_engine_cannot_run(tiny, tmp_path):
    d = edit_cfg(clone(tiny("qwen3"), tmp_path / "m"), use_sliding_window=True, sliding_window=16,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    st, msg = c_load(d)[:2]
    assert st == ST_UNSUPPORTED and "full-attention layer (1) after a sliding-window one (0)" in msg, msg
    d = edit_cfg(clone(tiny("qwen3"), tmp_path / "m2"), use_sliding_window=True, sliding_window=16, layer_types=["full_attention"])
    st, msg = c_load(d)[:2]
    assert st == ST_FORMAT and "layer_types" in msg, msg


def test_unknown_architecture_names_what_is_supported(tiny, tmp_path):
    d = edit_cfg(clone(tiny("llama"), tmp_path / "m"), model_type="gpt_neox")
    st, msg = c_load(d)[:2]
    assert st == ST_UNSUPPORTED and "gpt_neox" in msg and "qwen3" in msg and "gemma2" in msg and "gemma3_text" in msg, msg
    # a multimodal Gemma 3 config runs its text_config's model: without one, a clear error
    d = edit_cfg(clone(tiny("llama"), tmp_path / "m2"), model_type="gemma3")
    st, msg = c_load(d)[:2]
    assert st == ST_FORMAT and "'gemma3' config needs a 'text_config'" in msg, msg


# ------------------------------------------------------------------------------------------------
# folders, files and shards

def test_bad_folders(tiny, tmp_path):
    missing = tmp_path / "nowhere"
    st, msg = c_load(missing)[:2]
    assert st == ST_IO and "does not exist" in msg
    with pytest.raises(FileNotFoundError, match="does not exist"):
        kvpress_c.load_model(str(missing))

    empty = tmp_path / "empty"
    empty.mkdir()
    st, msg = c_load(empty)[:2]
    assert st == ST_IO and "no config.json in" in msg and "safetensors" in msg, msg
    with pytest.raises(OSError, match="no config.json"):
        kvpress_c.load_model(str(empty))

    d = tmp_path / "noweights"
    d.mkdir()
    shutil.copy(os.path.join(tiny("llama"), "config.json"), d / "config.json")
    st, msg = c_load(d)[:2]
    assert st == ST_IO and "no safetensors weights" in msg, msg
    with pytest.raises(OSError, match="safetensors"):
        kvpress_c.load_model(str(d))

    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: invalid JSON at byte 1"):
        kvpress_c.load_model(str(d))
    (d / "config.json").write_text("")
    with pytest.raises(ValueError, match="unexpected end"):
        kvpress_c.load_model(str(d))
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        kvpress_c.load_model(str(d))
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    with pytest.raises(OSError, match="config.json"):
        kvpress_c.load_model(str(d))


def test_weight_file_discovery(tiny, tmp_path):
    """model.safetensors first, then the index, then any *.safetensors."""
    d = clone(tiny("llama"), tmp_path / "renamed")
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "weights.safetensors"))
    assert c_load(d)[0] == ST_OK
    d = clone(tiny("llama", "float32", False, True), tmp_path / "glob")
    os.remove(os.path.join(d, "model.safetensors.index.json"))
    assert c_load(d)[0] == ST_OK
    d = clone(tiny("llama", "float32", False, True), tmp_path / "both")  # a stray single file wins
    shutil.copy(os.path.join(tiny("llama"), "model.safetensors"), os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        f.write("garbage")
    assert c_load(d)[0] == ST_OK


def test_index_errors(tiny, tmp_path):
    src = tiny("llama", "float32", False, True)

    def with_index(name, edit):
        d = clone(src, tmp_path / name)
        p = os.path.join(d, "model.safetensors.index.json")
        idx = json.load(open(p))
        edit(idx["weight_map"], idx)
        with open(p, "w") as f:
            json.dump(idx, f)
        return d

    shards = sorted({v for v in json.load(open(os.path.join(src, "model.safetensors.index.json")))["weight_map"].values()})
    wm = json.load(open(os.path.join(src, "model.safetensors.index.json")))["weight_map"]
    t = "model.layers.2.mlp.up_proj.weight"
    other = next(s for s in shards if s != wm[t])
    d = with_index("wrong_shard", lambda m, i: m.__setitem__(t, other))
    with pytest.raises(ValueError, match=f"tensor '{t}' in shard '{other}', but that file does not contain it"):
        kvpress_c.load_model(d)
    d = with_index("unlisted", lambda m, i: m.pop(t))
    with pytest.raises(ValueError, match=f"'{t}' is missing from .*index.json"):
        kvpress_c.load_model(d)
    d = with_index("no_file", lambda m, i: m.__setitem__(t, "model-99999.safetensors"))
    with pytest.raises(OSError, match="names the shard 'model-99999.safetensors'"):
        kvpress_c.load_model(d)
    d = with_index("escape", lambda m, i: m.__setitem__(t, "../model.safetensors"))
    with pytest.raises(ValueError, match="not a plain file name"):
        kvpress_c.load_model(d)
    d = with_index("not_str", lambda m, i: m.__setitem__(t, 3))
    with pytest.raises(ValueError, match="weight_map"):
        kvpress_c.load_model(d)
    d = with_index("no_map", lambda m, i: i.pop("weight_map"))
    with pytest.raises(ValueError, match="weight_map"):
        kvpress_c.load_model(d)
    d = clone(src, tmp_path / "shard_gone")
    os.remove(os.path.join(d, shards[-1]))
    with pytest.raises(OSError, match=shards[-1]):
        kvpress_c.load_model(d)


# ------------------------------------------------------------------------------------------------
# safetensors headers written by hand

def test_dtypes(tiny, tmp_path):
    def to_i32(h, data):
        h["model.norm.weight"]["dtype"] = "I32"  # same byte size as F32: only the conversion can object
        return h, data
    d = st_rewrite(clone(tiny("llama"), tmp_path / "i32"), to_i32)
    st, msg = c_load(d)[:2]
    assert st == ST_UNSUPPORTED and "model.norm.weight" in msg and "I32" in msg, msg
    with pytest.raises(NotImplementedError, match="model.norm.weight.*I32"):
        kvpress_c.load_model(d)

    def extras(h, data):  # unused tensors of other dtypes, metadata, header padding: all fine
        n = len(data)
        h["extra.ids"] = {"dtype": "I64", "shape": [3], "data_offsets": [n, n + 24]}
        h["extra.mask"] = {"dtype": "BOOL", "shape": [2, 2], "data_offsets": [n + 24, n + 28]}
        h["extra.u8"] = {"dtype": "U8", "shape": [0], "data_offsets": [n + 28, n + 28]}
        h["extra.scalar"] = {"dtype": "F64", "shape": [], "data_offsets": [n + 28, n + 36]}
        h["__metadata__"] = {"format": "pt", "note": "caf\u00e9 \U0001F600"}
        return json.dumps(h) + "      ", data + bytes(36) + bytes(100)  # trailing unused bytes are tolerated
    assert c_load(st_rewrite(clone(tiny("llama"), tmp_path / "extras"), extras))[0] == ST_OK


def header_case(name):
    """edit(header, data) for one corruption, and the expected message fragment."""
    W = "model.layers.0.self_attn.q_proj.weight"
    K = "model.layers.0.self_attn.k_proj.weight"

    def set_(key, value, tensor=W):
        def e(h, d):
            h[tensor][key] = value
            return h, d
        return e

    def overlap(h, d):
        b, e = h[K]["data_offsets"]
        h[W]["data_offsets"] = [b, b + (h[W]["data_offsets"][1] - h[W]["data_offsets"][0])]
        return h, d

    def dup(h, d):
        text = json.dumps(h)
        return text[:-1] + ', "model\\u002enorm.weight": ' + json.dumps(h["model.norm.weight"]) + "}", d

    def meta(value):
        def e(h, d):
            h["__metadata__"] = value
            return h, d
        return e

    cases = {
        "offsets_outside": (set_("data_offsets", [0, 10**9]), "outside the .*-byte data section"),
        "offsets_reversed": (set_("data_offsets", [100, 50]), "outside"),
        "offsets_negative": (set_("data_offsets", [-4, 16380]), "not non-negative integers"),
        "offsets_float": (set_("data_offsets", [0.5, 16384.5]), "not non-negative integers"),
        "offsets_three": (set_("data_offsets", [0, 1, 2]), "data_offsets"),
        "offsets_str": (set_("data_offsets", ["0", "16384"]), "not non-negative integers"),
        "size_mismatch": (set_("shape", [64, 32]), "has 16384 data bytes but shape x F32 needs 2048 x 4"),
        "shape_neg": (set_("shape", [-64, -64]), "invalid shape"),
        "shape_float": (set_("shape", [64, 64.5]), "invalid shape"),
        "shape_9d": (set_("shape", [1] * 7 + [64, 64]), "9 dimensions"),
        "shape_overflow": (set_("shape", [2**40, 2**40, 2**40]), "overflows"),
        "shape_null": (set_("shape", None), "needs \"dtype\""),
        "dtype_unknown": (set_("dtype", "F99"), "unknown dtype 'F99'"),
        "dtype_num": (set_("dtype", 32), "needs \"dtype\""),
        "dtype_nul": (set_("dtype", "F32\u0000"), "unknown dtype"),
        "dtype_size": (set_("dtype", "F16"), "needs 4096 x 2"),
        "entry_not_object": (lambda h, d: ({**h, W: [1, 2]}, d), "needs \"dtype\""),
        "missing_key": (lambda h, d: ({**h, W: {"dtype": "F32", "shape": [64, 64]}}, d), "data_offsets"),
        "overlap": (overlap, "share bytes"),
        "duplicate": (dup, "twice"),
        "meta_not_str": (meta({"a": 1}), "__metadata__"),
        "meta_list": (meta(["a"]), "__metadata__"),
        "not_object": (lambda h, d: ("[]", d), "not a JSON object"),
        "garbage": (lambda h, d: ("{\"a\": ", d), "invalid JSON"),
        "header_trailing": (lambda h, d: (json.dumps(h) + " x", d), "trailing characters"),
    }
    return cases[name]


HEADER_CASES = ["offsets_outside", "offsets_reversed", "offsets_negative", "offsets_float", "offsets_three", "offsets_str",
                "size_mismatch", "shape_neg", "shape_float", "shape_9d", "shape_overflow", "shape_null", "dtype_unknown",
                "dtype_num", "dtype_nul", "dtype_size", "entry_not_object", "missing_key", "overlap", "duplicate",
                "meta_not_str", "meta_list", "not_object", "garbage", "header_trailing"]


@pytest.mark.parametrize("case", HEADER_CASES)
def test_bad_safetensors_headers(tiny, tmp_path, case):
    edit, match = header_case(case)
    d = st_rewrite(clone(tiny("llama"), tmp_path / "m"), edit)
    st, msg = c_load(d)[:2]
    assert st == ST_FORMAT and "model.safetensors" in msg, msg
    with pytest.raises(ValueError, match=match):
        kvpress_c.load_model(d)


def test_bad_header_length(tiny, tmp_path):
    d = clone(tiny("llama"), tmp_path / "m")
    p = os.path.join(d, "model.safetensors")
    raw = open(p, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    for value in (0, 1, len(raw) - 7, 2**40, 2**63, 2**64 - 1):
        open(p, "wb").write(struct.pack("<Q", value) + raw[8:])
        with pytest.raises(ValueError, match=f"header length {value} does not fit"):
            kvpress_c.load_model(d)
    for size in (0, 5, 9):
        open(p, "wb").write(raw[:size])
        with pytest.raises(ValueError, match="too small"):
            kvpress_c.load_model(d)
    # a 101 MB header is refused before it is parsed
    big = 101 << 20
    with open(p, "wb") as f:  # sparse: only the length is written
        f.write(struct.pack("<Q", big) + b"{")
        f.truncate(8 + big)
    with pytest.raises(ValueError, match="at most 104857600"):
        kvpress_c.load_model(d)


def test_escaped_tensor_names(tiny, tmp_path):
    """Names are compared after unescaping: \\u002e is '.', and a surrogate pair is one character."""
    def esc(h, d):
        text = json.dumps(h, ensure_ascii=True)
        text = text.replace('"model.norm.weight"', '"model\\u002enorm\\u002Eweight"')
        text = text.replace('"model.embed_tokens.weight"', '"\\u006dodel.embed_tokens.weight"')
        return text[:-1] + ', "\\ud83d\\ude00\\n\\t\\"\\\\\\/\\b\\f\\r": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}', d
    d = st_rewrite(clone(tiny("llama"), tmp_path / "m"), esc)
    st, msg = c_load(d)[:2]
    assert st == ST_OK, msg


# ------------------------------------------------------------------------------------------------
# JSON parser edge cases through config.json

def config_with(tiny, tmp_path, raw_value, key="extra"):
    """config.json of the tiny llama with `"key": <raw_value>` appended as raw JSON text/bytes."""
    d = clone(tiny("llama"), tmp_path / "m")
    text = json.dumps(read_cfg(d)).encode()
    raw = raw_value.encode() if isinstance(raw_value, str) else raw_value
    write_cfg(d, text=text[:-1] + b', "' + key.encode() + b'": ' + raw + b"}")
    return d


@pytest.mark.parametrize("raw", [
    '"\\ud83d\\ude00 \\u00e9 \\u20AC \\n\\t\\r\\b\\f\\/\\\\\\""', '"caf\u00e9 \u4e2d \U0001F600"', '"\\u0000"',
    '[1, 2.5e3, -0.0, 0, -0, 1E+2, 1e-2, 0.125, true, false, null, "", {}, []]',
    "[" * 63 + "]" * 63,  # depth 64 with the enclosing object
    " \t\r\n{ \"a\" : [ 1 , { } ] } \n",
    "1" + "0" * 300, "0." + "1" * 400, "1" * 400 + "e-400",  # long (valid) numbers
    '{"k": 1, "K": 2, "k2": 3}',
])
def test_json_accepts_valid(tiny, tmp_path, raw):
    st, msg = c_load(config_with(tiny, tmp_path, raw))[:2]
    assert st == ST_OK, msg


@pytest.mark.parametrize("raw,match", [
    ("01", "leading zero"), ("-", "expected a digit"), (".5", "unexpected character"), ("1.", "after '.'"),
    ("1e", "exponent"), ("1e+", "exponent"), ("+1", "unexpected character"), ("1e400", "out of the double range"),
    ("-1e400", "out of the double range"), ("NaN", "unexpected character"), ("Infinity", "unexpected character"),
    ("0x10", "expected ','"), ("tru", "unexpected character"), ("nul", "unexpected character"),
    ('"\\ud83d"', "high surrogate"), ('"\\ude00"', "lone low surrogate"), ('"\\ud83d\\u0041"', "high surrogate"),
    ('"\\u12"', "bad hex digit"), ('"\\u12G4"', "bad hex digit"), ('"\\q"', "unknown escape"), ('"\\x41"', "unknown escape"),
    ('"a\tb"', "raw control character"), ('"a\nb"', "raw control character"), (b'"\xff"', "invalid UTF-8"),
    (b'"\xc0\xaf"', "invalid UTF-8"), (b'"\xed\xa0\x80"', "invalid UTF-8"), (b'"\xe2\x82"', "invalid UTF-8"),
    (b'"\xf4\x90\x80\x80"', "invalid UTF-8"), ('"abc', "unterminated string"), ("[1, 2", "expected ','"),
    ("[1,]", "unexpected character"), ('{"a": 1,}', "expected a string key"), ('{"a" 1}', "expected ':'"),
    ("{'a': 1}", "expected a string key"), ('{"a": 1, "a": 2}', "key \"a\" appears twice"), ('{"a\\u0000": 1}', "\\\\u0000"),
    ("[" * 64 + "]" * 64, "nesting deeper than 64"), ("[" * 100000, "nesting deeper than 64"),
    ("1 /* c */", "expected ','"), ("[1] 2", "expected ','"),
])
def test_json_rejects_invalid(tiny, tmp_path, raw, match):
    d = config_with(tiny, tmp_path, raw)
    st, msg = c_load(d)[:2]
    assert st == ST_FORMAT and "config.json: invalid JSON at byte " in msg, msg
    with pytest.raises(ValueError, match=match):
        kvpress_c.load_model(d)


def test_json_top_level(tiny, tmp_path):
    d = clone(tiny("llama"), tmp_path / "m")
    text = json.dumps(read_cfg(d))
    for bad, match in [(text + " x", "trailing characters"), (text + text, "trailing characters"),
                       ("\ufeff" + text, "at byte 0: unexpected character"), ("   ", "unexpected end"),
                       (text[:-1], "unterminated object"), ('{"model_type": "llama",}', "expected a string key")]:
        write_cfg(d, text=bad)
        with pytest.raises(ValueError, match=match):
            kvpress_c.load_model(d)
    write_cfg(d, text="\n  " + text + "  \n\t")
    assert c_load(d)[0] == ST_OK


def test_json_strings_decode_to_utf8(tiny, tmp_path):
    """Escapes reach the C side as UTF-8: an escaped "llama" loads, and an unsupported model_type is
    quoted back in the error message exactly."""
    d = clone(tiny("llama"), tmp_path / "m")
    text = json.dumps(read_cfg(d))
    write_cfg(d, text=text.replace('"model_type": "llama"', '"model_type": "\\u006C\\u006c\\u0061m\\u0061"'))
    assert c_load(d)[0] == ST_OK
    write_cfg(d, text=text.replace('"model_type": "llama"', '"model_type": "ll\\u00e1ma\\ud83d\\ude00\\u4e2d"'))
    st, msg = c_load(d)[:2]
    assert st == ST_UNSUPPORTED and "model_type 'll\u00e1ma\U0001F600\u4e2d' is not supported" in msg, msg


def test_json_numbers_are_correctly_rounded(tiny, tmp_path):
    d = clone(tiny("llama"), tmp_path / "m")
    for eps in ("1e-5", "1E-05", "0.00001", "1.0e-5", "10e-6", "0.000010000000000000000000000000000000000001"):
        write_cfg(d, text=json.dumps(read_cfg(d))[:-1].replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": ' + eps) + "}")
        assert c_load(d)[2].rms_eps == np.float32(1e-5), eps


# ------------------------------------------------------------------------------------------------
# fuzzing (subprocess: a crash must fail the test, not kill pytest)

FUZZ = textwrap.dedent(r'''
    import ctypes, json, os, random, shutil, struct, sys
    lib = ctypes.CDLL(sys.argv[1]); lib.kvc_last_error.restype = ctypes.c_char_p
    lib.kvc_model_load.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.kvc_model_free.argtypes = [ctypes.c_void_p]
    single, sharded, work, seed, n = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
    keep = sys.argv[7] if len(sys.argv) > 7 else None   # keep every case (for a sanitizer run)
    rng = random.Random(seed)
    st_bytes = open(os.path.join(single, 'model.safetensors'), 'rb').read()
    cfg_text = open(os.path.join(single, 'config.json')).read()
    CFG = json.loads(cfg_text)
    hlen = struct.unpack('<Q', st_bytes[:8])[0]
    HDR = json.loads(st_bytes[8:8 + hlen]); DATA = st_bytes[8 + hlen:]
    NAMES = [k for k in HDR if k != '__metadata__']
    INDEX = json.load(open(os.path.join(sharded, 'model.safetensors.index.json')))
    VALUES = [0, -1, 1, 2, 3, 7, 2**31, 2**63, -2**63, 1e300, -1e-300, 0.5, 'x', '', None, True, [], [1, 2], {}, {'a': 1}]
    KEYS = ['num_hidden_layers', 'hidden_size', 'num_attention_heads', 'num_key_value_heads', 'intermediate_size',
            'vocab_size', 'rms_norm_eps', 'head_dim', 'model_type', 'max_position_embeddings', 'tie_word_embeddings',
            'bos_token_id', 'eos_token_id', 'rope_parameters', 'rope_scaling', 'rope_theta', 'hidden_act', 'sliding_window']

    def pack(h, data):
        raw = (h if isinstance(h, str) else json.dumps(h)).encode('utf-8', 'surrogatepass')
        return struct.pack('<Q', len(raw)) + raw + data

    def hdr_copy():
        return json.loads(json.dumps(HDR))

    def mutate(kind):
        """-> (files to write {name: bytes}, use the sharded folder?)"""
        b, c, h = bytearray(st_bytes), cfg_text, None
        if kind == 0:    # truncation
            b = b[:rng.randrange(0, len(b))]
        elif kind == 1:  # bit flips in the header length
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(8)] ^= 1 << rng.randrange(8)
        elif kind == 2:  # bit flips in the JSON header
            for _ in range(rng.randint(1, 4)):
                p = rng.randrange(8, 8 + hlen); b[p] ^= 1 << rng.randrange(8)
        elif kind == 3:  # header length lies
            b[:8] = struct.pack('<Q', rng.choice([0, 1, 2, hlen - 1, hlen + 1, len(b) - 8, len(b) - 7, 100 << 20,
                                                  (100 << 20) + 1, 2**40, 2**63, 2**64 - 1]))
        elif kind == 4:  # a digit run in the header replaced
            text = json.dumps(HDR)
            runs = [(i, j) for i in range(len(text)) if text[i].isdigit() and (i == 0 or not text[i - 1].isdigit())
                    for j in [i + len(text[i:]) - len(text[i:].lstrip('0123456789'))]]
            i, j = rng.choice(runs)
            h = text[:i] + str(rng.choice([0, 1, 7, 63, 64, 65, 99999999, 2**53, 2**64, 10**30, -5])) + text[j:]
        elif kind == 5:  # dtype lies
            h = hdr_copy(); t = h[rng.choice(NAMES)]
            t['dtype'] = rng.choice(['F16', 'BF16', 'I64', 'U8', 'F64', 'BOOL', 'F8_E4M3', 'F99', '', 'f32', 7, None])
        elif kind == 6:  # shape lies
            h = hdr_copy(); t = h[rng.choice(NAMES)]; s = t['shape']
            t['shape'] = rng.choice([s[::-1], s[:1], s + [1], [1] + s, [-x for x in s], [x + 0.5 for x in s], [1] * 9, [],
                                     [0] * len(s), [2**62, 2**62], [str(x) for x in s], s * 2, None, 'x'])
        elif kind == 7:  # offset lies: overlaps, outside, reversed, swapped
            h = hdr_copy(); a, z = rng.sample(NAMES, 2); ta, tz = h[a], h[z]
            r = rng.randrange(5)
            if r == 0:
                ta['data_offsets'] = list(tz['data_offsets'])
            elif r == 1:
                ta['data_offsets'] = [ta['data_offsets'][0] + 4, ta['data_offsets'][1] + 4]
            elif r == 2:
                ta['data_offsets'] = ta['data_offsets'][::-1]
            elif r == 3:
                ta['data_offsets'], tz['data_offsets'] = tz['data_offsets'], ta['data_offsets']
            else:
                ta['data_offsets'] = [len(DATA) - 4, len(DATA) + rng.choice([0, 4, 2**40])]
        elif kind == 8:  # structural edits of the header text
            text = json.dumps(HDR); p = rng.randrange(len(text))
            r = rng.randrange(4)
            if r == 0:
                h = text[:p] + text[p + 1:]
            elif r == 1:
                h = text[:p] + rng.choice('{}[]",:\\ \x00\x7f') + text[p:]
            elif r == 2:
                nm = rng.choice(NAMES); h = text[:-1] + ', ' + json.dumps(nm) + ': ' + json.dumps(HDR[nm]) + '}'
            else:
                h = text[:p] + rng.choice(['\\ud800', '\\u', '\udc00', '\xff', '"', '1e999', '[' * 70, 'null']) + text[p:]
        elif kind == 9:  # config.json: wrong types, negative or huge sizes
            cfg = json.loads(cfg_text)
            for _ in range(rng.randint(1, 3)):
                cfg[rng.choice(KEYS)] = rng.choice(VALUES)
            c = json.dumps(cfg)
        elif kind == 10:  # config.json: missing keys
            cfg = json.loads(cfg_text)
            for k in rng.sample(KEYS, rng.randint(1, 4)):
                cfg.pop(k, None)
            c = json.dumps(cfg)
        elif kind == 11:  # config.json: head counts that do not divide, odd or huge head_dim
            cfg = json.loads(cfg_text)
            cfg['num_attention_heads'] = rng.choice([1, 2, 3, 4, 5, 8, 1024])
            cfg['num_key_value_heads'] = rng.choice([1, 2, 3, 4, 6, None])
            cfg['head_dim'] = rng.choice([None, 1, 3, 8, 15, 16, 32, 256, 258])
            c = json.dumps(cfg)
        elif kind == 12:  # config.json: byte-level damage
            cb = bytearray(cfg_text.encode())
            for _ in range(rng.randint(1, 4)):
                p = rng.randrange(len(cb)); cb[p] ^= 1 << rng.randrange(8)
            c = bytes(cb)
        elif kind == 13:  # sharded folder, index damage
            idx = json.loads(json.dumps(INDEX)); wm = idx['weight_map']; t = rng.choice(sorted(wm))
            r = rng.randrange(6)
            if r == 0:
                wm.pop(t)
            elif r == 1:
                wm[t] = rng.choice(sorted(set(wm.values())))
            elif r == 2:
                wm[t] = rng.choice(['missing.safetensors', '../x.safetensors', '', '/etc/passwd', 'config.json', '.'])
            elif r == 3:
                wm[t] = rng.choice([1, None, [], {}])
            elif r == 4:
                idx['weight_map'] = rng.choice([[], 'x', None, {}])
            else:
                return {'model.safetensors.index.json': json.dumps(idx)[:rng.randrange(60)].encode()}, True
            return {'model.safetensors.index.json': json.dumps(idx).encode()}, True
        if h is not None:
            b = pack(h, DATA)
        return {'model.safetensors': bytes(b), 'config.json': c.encode() if isinstance(c, str) else c}, False

    counts, kinds = {'rejected': 0, 'loaded': 0}, 14
    for i in range(n):
        kind = i % kinds
        files, use_sharded = mutate(kind)
        case = os.path.join(keep, f'case{i:04d}') if keep else work
        shutil.rmtree(case, ignore_errors=True)
        shutil.copytree(sharded if use_sharded else single, case)
        for name, data in files.items():
            with open(os.path.join(case, name), 'wb') as f:
                f.write(data)
        m = ctypes.c_void_p()
        st = lib.kvc_model_load(case.encode(), ctypes.byref(m))
        if st == 0:
            counts['loaded'] += 1; lib.kvc_model_free(m)
        else:
            counts['rejected'] += 1
            msg = lib.kvc_last_error()
            assert 1 <= st <= 7 and not m.value, (i, kind, st)
            assert msg and len(msg) > 10, f'case {i} (kind {kind}): status {st} without a message'
    print(f"{n} corruptions (seed {seed}): {counts['rejected']} rejected with a message, {counts['loaded']} loaded")
''')


def test_fuzz_corrupt_files_never_crash(tmp_path_factory, tmp_path, rng):
    root = tmp_path_factory.mktemp("fuzzsrc")
    seed = int(rng.integers(1 << 30))
    small = dict(vocab=64, layers=2, seed=seed, with_tokenizer=False)
    single = write_tiny_model(str(root / "single"), arch="qwen2", **small)
    sharded = write_tiny_model(str(root / "sharded"), arch="llama", sharded=True, **small)
    script = tmp_path / "fuzz.py"
    script.write_text(FUZZ)
    n = 14 * 20
    res = subprocess.run([sys.executable, str(script), core_library_path(), single, sharded, str(tmp_path / "w"), str(seed), str(n)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"fuzzer failed (seed {seed}): rc={res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    print(res.stdout)
    assert f"{n} corruptions (seed {seed})" in res.stdout
    rejected = int(res.stdout.split(": ")[1].split()[0])
    assert rejected >= n // 2, res.stdout  # most corruptions must be caught
