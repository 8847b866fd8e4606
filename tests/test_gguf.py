"""GGUF: dequantisation against float64 references and gguf-py, config reading, and bad files
(truncated, bit-flipped, lying) that must raise clear errors and never crash."""
import ctypes as C
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvpress_c
from capi import lib

gguf = pytest.importorskip("gguf")

lib.kvc_kernel_dequantize.argtypes = [C.c_int32, C.c_void_p, C.c_size_t, np.ctypeslib.ndpointer(np.float32), C.c_int64]
F16 = np.float16


def dequant(type_, raw, n):
    out = np.zeros(n, dtype=np.float32)
    buf = np.frombuffer(raw, dtype=np.uint8)
    st = lib.kvc_kernel_dequantize(type_, buf.ctypes.data, len(raw), out, n)
    assert st == 0, lib.kvc_last_error()
    return out


def random_blocks(rng, n_blocks, kind):
    """Random ggml blocks with sane fp16 scales, and their float64 values from the block layout."""
    raw, ref = bytearray(), []
    for _ in range(n_blocks):
        d = F16(rng.uniform(-0.1, 0.1))
        if kind == "q8_0":
            q = rng.integers(-128, 128, size=32).astype(np.int8)
            raw += d.tobytes() + q.tobytes()
            ref.append(np.float64(d) * q)
        else:
            q = rng.integers(0, 16, size=32)
            packed = (q[:16] | (q[16:] << 4)).astype(np.uint8)
            if kind == "q4_0":
                raw += d.tobytes() + packed.tobytes()
                ref.append((q - 8) * np.float64(d))
            else:
                m = F16(rng.uniform(-1, 1))
                raw += d.tobytes() + m.tobytes() + packed.tobytes()
                ref.append(q * np.float64(d) + np.float64(m))
    return bytes(raw), np.concatenate(ref)


@pytest.mark.parametrize("kind,code", [("q4_0", 2), ("q4_1", 3), ("q8_0", 8)])
def test_dequantize_blocks_against_reference(rng, kind, code):
    raw, ref = random_blocks(rng, 37, kind)
    out = dequant(code, raw, 37 * 32)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)


def test_dequantize_float_types(rng):
    x = rng.standard_normal(100)
    np.testing.assert_array_equal(dequant(0, x.astype(np.float32).tobytes(), 100), x.astype(np.float32))
    np.testing.assert_array_equal(dequant(1, x.astype(np.float16).tobytes(), 100), x.astype(np.float16).astype(np.float32))
    bf = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(dequant(30, bf.tobytes(), 100), (bf.astype(np.uint32) << 16).view(np.float32))


def test_dequantize_rejects_bad_sizes():
    out = np.zeros(32, dtype=np.float32)
    buf = np.zeros(20, dtype=np.uint8)
    assert lib.kvc_kernel_dequantize(3, buf.ctypes.data, 19, out, 32) == 1  # wrong byte count
    assert lib.kvc_kernel_dequantize(3, buf.ctypes.data, 20, out, 31) != 0  # not whole blocks
    assert lib.kvc_kernel_dequantize(99, buf.ctypes.data, 20, out, 32) == 5  # unknown type


def test_dequantize_matches_gguf_py_on_default_model(default_gguf):
    r = gguf.GGUFReader(default_gguf)
    names = {"token_embd.weight", "blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.0.attn_norm.weight"}
    for t in r.tensors:
        if t.name not in names:
            continue
        n = int(np.prod(t.shape))
        ours = dequant(int(t.tensor_type), bytes(t.data.tobytes()), n)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)
        np.testing.assert_array_equal(ours, ref.astype(np.float32), err_msg=t.name)


def test_default_model_config(default_model):
    c = default_model.config
    assert (c["arch"], c["n_layers"], c["hidden"], c["n_heads"], c["n_kv_heads"], c["head_dim"], c["ffn"], c["vocab"]) == \
        ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert c["rope_pairing"] == "adjacent" and c["tied_embeddings"] and c["rope_theta"] == 100000.0
    meta = default_model.metadata()
    assert meta["general.architecture"] == "llama" and len(meta["tokenizer.ggml.tokens"]) == 49152


# -- small GGUF files written here -------------------------------------------------------------------

def write_tiny_gguf(path, arch="llama", types=None, rope_freqs=False, bias=False, seed=0):
    """A 2-layer model (hidden 32, 4 heads / 2 KV heads, ffn 64, vocab 64) with random weights."""
    rng = np.random.default_rng(seed)
    types = types or {}
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(2)
    w.add_embedding_length(32)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_feed_forward_length(64)
    w.add_context_length(256)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_uint32(f"{arch}.vocab_size", 64)

    def add(name, shape, qtype=None):
        x = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        qt = types.get(name.split(".")[-2] if name.startswith("blk") else name, qtype)
        if qt is None:
            w.add_tensor(name, x)
        elif qt == "f16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            enum = getattr(gguf.GGMLQuantizationType, qt.upper())
            w.add_tensor(name, gguf.quants.quantize(x, enum), raw_shape=gguf.quants.quant_shape_to_byte_shape(x.shape, enum), raw_dtype=enum)

    add("token_embd.weight", (64, 32))
    add("output_norm.weight", (32,))
    for l in range(2):
        add(f"blk.{l}.attn_norm.weight", (32,))
        add(f"blk.{l}.attn_q.weight", (32, 32))
        add(f"blk.{l}.attn_k.weight", (16, 32))
        add(f"blk.{l}.attn_v.weight", (16, 32))
        add(f"blk.{l}.attn_output.weight", (32, 32))
        if bias:
            add(f"blk.{l}.attn_q.bias", (32,))
            add(f"blk.{l}.attn_k.bias", (16,))
            add(f"blk.{l}.attn_v.bias", (16,))
        add(f"blk.{l}.ffn_norm.weight", (32,))
        add(f"blk.{l}.ffn_gate.weight", (64, 32))
        add(f"blk.{l}.ffn_up.weight", (64, 32))
        add(f"blk.{l}.ffn_down.weight", (32, 64))
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", np.linspace(1, 8, 4).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("variant", ["f32", "quant", "qwen2", "rope_freqs"])
def test_tiny_gguf_variants_load(tmp_path, variant):
    kw = {"f32": {}, "quant": {"types": {"attn_q": "q8_0", "ffn_up": "q4_0", "ffn_gate": "q4_1", "attn_k": "f16"}},
          "qwen2": {"arch": "qwen2", "bias": True}, "rope_freqs": {"rope_freqs": True}}[variant]
    path = write_tiny_gguf(str(tmp_path / "m.gguf"), **kw)
    m = kvpress_c.load_model(path)
    c = m.config
    assert (c["n_layers"], c["hidden"], c["n_heads"], c["n_kv_heads"], c["head_dim"], c["vocab"]) == (2, 32, 4, 2, 8, 64)
    assert c["rope_pairing"] == ("half" if variant == "qwen2" else "adjacent")
    assert c["qkv_bias"] == (variant == "qwen2")
    logits = m.logits([1, 2, 3, 4, 5])
    assert logits.shape == (5, 64) and np.all(np.isfinite(logits))


def test_missing_path_and_wrong_kind_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        kvpress_c.load_model(str(tmp_path / "nope.gguf"))
    bad = tmp_path / "text.gguf"
    bad.write_bytes(b"this is not a model file at all, just some text")
    with pytest.raises(ValueError, match="not a GGUF file"):
        kvpress_c.load_model(str(bad))
    with pytest.raises(OSError, match="config.json"):
        kvpress_c.load_model(str(tmp_path))


FUZZ = textwrap.dedent("""
    import ctypes, random, struct, sys
    lib = ctypes.CDLL(sys.argv[1]); lib.kvc_last_error.restype = ctypes.c_char_p
    data = open(sys.argv[2], 'rb').read(); out = sys.argv[3]; seed = int(sys.argv[4]); n = int(sys.argv[5])
    rng = random.Random(seed)
    header_end = int(sys.argv[6])
    ok = failed = 0
    for i in range(n):
        b = bytearray(data)
        kind = i % 5
        if kind == 0:    # truncation
            b = b[:rng.randrange(0, len(b))]
        elif kind == 1:  # bit flips in the header / metadata / tensor infos
            for _ in range(rng.randint(1, 4)):
                p = rng.randrange(0, header_end); b[p] ^= 1 << rng.randrange(8)
        elif kind == 2:  # a lying 64-bit count or length somewhere in the header
            p = rng.randrange(0, header_end - 8)
            b[p:p + 8] = struct.pack('<Q', rng.choice([0, 1, 2**31, 2**32 + 5, 2**63 - 1, 2**64 - 1, rng.randrange(2**40)]))
        elif kind == 3:  # a lying 32-bit field (type, dims)
            p = rng.randrange(0, header_end - 4)
            b[p:p + 4] = struct.pack('<I', rng.choice([0, 4, 5, 9, 13, 30, 255, 2**31]))
        else:            # random bytes over a random span
            p = rng.randrange(0, len(b)); L = rng.randint(1, 64)
            b[p:p + L] = bytes(rng.randrange(256) for _ in range(min(L, len(b) - p)))
        open(out, 'wb').write(b)
        m = ctypes.c_void_p()
        st = lib.kvc_model_load(out.encode(), ctypes.byref(m))
        if st == 0:
            ok += 1; lib.kvc_model_free(m)
        else:
            failed += 1
            assert lib.kvc_last_error(), 'a failure without a message'
    print(f'{n} corruptions: {failed} rejected with a message, {ok} loaded')
""")


def header_size(path):
    r = gguf.GGUFReader(path)
    return int(min(t.data_offset for t in r.tensors))


def test_fuzz_corrupt_gguf_never_crashes(tmp_path, rng):
    path = write_tiny_gguf(str(tmp_path / "base.gguf"), types={"attn_q": "q8_0", "ffn_up": "q4_1"})
    seed = int(rng.integers(1 << 30))
    script = tmp_path / "fuzz.py"
    script.write_text(FUZZ)
    res = subprocess.run([sys.executable, str(script), kvpress_c.core_library_path(), path, str(tmp_path / "bad.gguf"),
                          str(seed), "250", str(header_size(path))], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"fuzzer crashed (seed {seed}): rc={res.returncode}\n{res.stderr[-2000:]}"
    print(res.stdout)
    assert "250 corruptions" in res.stdout


def test_corrupt_gguf_raises_python_errors(tmp_path, rng):
    path = write_tiny_gguf(str(tmp_path / "base.gguf"))
    data = open(path, "rb").read()
    cases = {"truncated": data[: len(data) // 2], "header-only": data[:100],
             "bad-version": data[:4] + (99).to_bytes(4, "little") + data[8:],
             "huge-count": data[:8] + (2**62).to_bytes(8, "little") + data[16:]}
    for name, blob in cases.items():
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(blob)
        with pytest.raises((ValueError, NotImplementedError, OSError)) as e:
            kvpress_c.load_model(str(p))
        assert str(e.value), name


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
