"""Hugging Face folders: config variants, shards, RoPE scaling, and bad files/configs (fuzzed) that
must raise clear errors and never crash."""
import ctypes as C
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvpress_c
from capi import lib

pytest.importorskip("torch")
from hf_models import write_tiny_model  # noqa: E402


class Config(C.Structure):
    _fields_ = [(n, C.c_int32) for n in ("arch", "n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab",
                                         "max_context", "rope_pairing", "tied_embeddings", "qkv_bias")] + \
               [("rms_eps", C.c_float), ("rope_theta", C.c_float), ("rope_scaling_factor", C.c_float),
                ("rope_low_freq_factor", C.c_float), ("rope_high_freq_factor", C.c_float),
                ("rope_original_context", C.c_int32), ("bos_id", C.c_int32), ("eos_id", C.c_int32)]


lib.kvc_kernel_rope_freqs.argtypes = [C.POINTER(Config), np.ctypeslib.ndpointer(np.float32)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(str(tmp_path_factory.mktemp("st") / "llama"), arch="llama", seed=3)


@pytest.mark.parametrize("arch,dtype,tied,sharded", [("llama", "float32", False, False), ("mistral", "float16", False, False),
                                                     ("qwen2", "bfloat16", True, False), ("llama", "float32", False, True)])
def test_variants_load_through_ctypes(tmp_path, arch, dtype, tied, sharded):
    path = write_tiny_model(str(tmp_path / "m"), arch=arch, dtype=dtype, tied=tied, sharded=sharded)
    if sharded:
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    m = C.c_void_p()
    assert lib.kvc_model_load(path.encode(), C.byref(m)) == 0, lib.kvc_last_error()
    cfg = Config()
    lib.kvc_model_get_config(m, C.byref(cfg))
    lib.kvc_model_free(m)
    assert (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn, cfg.vocab) == (4, 64, 4, 2, 16, 128, 256)
    assert cfg.arch == {"llama": 0, "mistral": 1, "qwen2": 2}[arch] and cfg.rope_pairing == 0
    assert cfg.qkv_bias == (arch == "qwen2") and cfg.tied_embeddings == tied


def test_llama3_rope_frequencies():
    """kvc_kernel_rope_freqs against transformers' llama3 formula written in float64."""
    cfg = Config(head_dim=128, rope_theta=500000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                 rope_high_freq_factor=4.0, rope_original_context=8192)
    out = np.zeros(64, dtype=np.float32)
    assert lib.kvc_kernel_rope_freqs(C.byref(cfg), out) == 0
    inv = 500000.0 ** (-np.arange(0, 128, 2) / 128)
    wl = 2 * np.pi / inv
    lo_wl, hi_wl = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wl - 1.0) / (4.0 - 1.0)
    ref = np.where(wl > lo_wl, inv / 8, np.where(wl < hi_wl, inv, (1 - smooth) * inv / 8 + smooth * inv))
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    assert (out != inv.astype(np.float32)).any()


def test_bad_folders_raise(tmp_path, tiny_dir):
    with pytest.raises(OSError, match="config.json"):
        kvpress_c.load_model(str(tmp_path))
    d = tmp_path / "noweights"
    d.mkdir()
    shutil.copy(os.path.join(tiny_dir, "config.json"), d / "config.json")
    with pytest.raises(OSError, match="safetensors"):
        kvpress_c.load_model(str(d))
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        kvpress_c.load_model(str(d))


def edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


@pytest.mark.parametrize("changes,exc,match", [
    ({"model_type": "gpt2"}, NotImplementedError, "not supported"),
    ({"num_attention_heads": 3}, ValueError, "multiple|shape"),  # heads no longer divide / shapes wrong
    ({"hidden_size": -4}, ValueError, "hidden_size"),
    ({"num_hidden_layers": "four"}, ValueError, "num_hidden_layers"),
    ({"vocab_size": ...}, ValueError, "vocab_size"),
    ({"intermediate_size": 100}, ValueError, "shape"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, NotImplementedError, "yarn"),
])
def test_wrong_config_values(tmp_path, tiny_dir, changes, exc, match):
    d = edit_config(tiny_dir, str(tmp_path / "m"), **changes)
    with pytest.raises(exc, match=match):
        kvpress_c.load_model(d)


FUZZ = textwrap.dedent("""
    import ctypes, json, os, random, shutil, struct, sys
    lib = ctypes.CDLL(sys.argv[1]); lib.kvc_last_error.restype = ctypes.c_char_p
    src = sys.argv[2]; work = sys.argv[3]; seed = int(sys.argv[4]); n = int(sys.argv[5])
    rng = random.Random(seed)
    st_bytes = open(os.path.join(src, 'model.safetensors'), 'rb').read()
    cfg_text = open(os.path.join(src, 'config.json')).read()
    hlen = struct.unpack('<Q', st_bytes[:8])[0]
    counts = {'rejected': 0, 'loaded': 0}
    for i in range(n):
        shutil.rmtree(work, ignore_errors=True); os.makedirs(work)
        b, c = bytearray(st_bytes), cfg_text
        kind = i % 6
        if kind == 0:
            b = b[:rng.randrange(0, len(b))]
        elif kind == 1:
            for _ in range(rng.randint(1, 4)):
                p = rng.randrange(0, 8 + hlen); b[p] ^= 1 << rng.randrange(8)
        elif kind == 2:
            b[:8] = struct.pack('<Q', rng.choice([0, 1, hlen + 1, hlen - 1, 2**40, 2**64 - 1]))
        elif kind == 3:  # lying numbers inside the JSON header
            hdr = b[8:8 + hlen].decode('utf-8', 'replace')
            digits = [j for j, ch in enumerate(hdr) if ch.isdigit()]
            j = rng.choice(digits)
            hdr = hdr[:j] + str(rng.choice([0, 9, 99999999, 10**20])) + hdr[j + 1:]
            raw = hdr.encode(); b = bytearray(struct.pack('<Q', len(raw))) + raw + b[8 + hlen:]
        elif kind == 4:  # dtype swaps
            hdr = b[8:8 + hlen].decode()
            hdr = hdr.replace('"F32"', rng.choice(['"F16"', '"I64"', '"F99"', '"BF16"']), 1)
            raw = hdr.encode(); b = bytearray(struct.pack('<Q', len(raw))) + raw + b[8 + hlen:]
        else:           # config.json values
            cfg = json.loads(cfg_text)
            key = rng.choice(['num_hidden_layers', 'hidden_size', 'num_attention_heads', 'num_key_value_heads',
                              'intermediate_size', 'vocab_size', 'rms_norm_eps', 'head_dim', 'model_type'])
            cfg[key] = rng.choice([0, -1, 3, 2**31, 1e300, 'x', None, [], {}, 0.5])
            c = json.dumps(cfg)
        open(os.path.join(work, 'model.safetensors'), 'wb').write(b)
        open(os.path.join(work, 'config.json'), 'w').write(c)
        m = ctypes.c_void_p()
        if lib.kvc_model_load(work.encode(), ctypes.byref(m)) == 0:
            counts['loaded'] += 1; lib.kvc_model_free(m)
        else:
            counts['rejected'] += 1
            assert lib.kvc_last_error(), 'a failure without a message'
    print(f"{n} corruptions: {counts['rejected']} rejected with a message, {counts['loaded']} loaded")
""")


def test_fuzz_corrupt_safetensors_never_crashes(tmp_path, tiny_dir, rng):
    seed = int(rng.integers(1 << 30))
    script = tmp_path / "fuzz.py"
    script.write_text(FUZZ)
    res = subprocess.run([sys.executable, str(script), kvpress_c.core_library_path(), tiny_dir, str(tmp_path / "w"),
                          str(seed), "240"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"fuzzer crashed (seed {seed}): rc={res.returncode}\n{res.stderr[-2000:]}"
    print(res.stdout)
    assert "240 corruptions" in res.stdout


@pytest.mark.parametrize("text", ['{"a": "\\ud83d\\ude00 \\u00e9 \\n"}', '{"a": [1, 2.5e3, -0.0, true, false, null]}',
                                  "[" * 20 + "1" + "]" * 20])
def test_json_parser_accepts_valid(tmp_path, tiny_dir, text):
    # a valid header with an extra __metadata__-free entry is not needed: parse via config.json's extra key
    d = edit_config(tiny_dir, str(tmp_path / "m"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    raw = json.dumps(cfg)[:-1] + ', "extra": ' + text + "}"
    open(os.path.join(d, "config.json"), "w").write(raw)
    kvpress_c.load_model(d)


@pytest.mark.parametrize("text", ['{"a": 01}', '{"a": "\\ud83d"}', '{"a": 1,}', '{"a" 1}', "[" * 100 + "]" * 100, '{"a": 1} x',
                                  '{"a": "\\q"}', '{"a": 1e999}'])
def test_json_parser_rejects_invalid(tmp_path, tiny_dir, text):
    d = edit_config(tiny_dir, str(tmp_path / "m"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    raw = json.dumps(cfg)[:-1] + ', "extra": ' + text + "}"
    open(os.path.join(d, "config.json"), "w").write(raw)
    with pytest.raises(ValueError, match="JSON"):
        kvpress_c.load_model(d)
