"""Saved caches (kvpress_c/saved.py, csrc/persist/): save -> load -> answer equals answer without saving for every
press family; the file's digest against hashlib; the safetensors package reads the file; a different model, a
newer format version, a truncated or corrupt file: ValueError saying which."""
import hashlib
import json
import os
import struct

import numpy as np
import pytest

import kvpress_c
from kvpress_c import _core
from random_llama import write_random_llama

CONTEXT = ("Alice lives in Paris and keeps a red bicycle. Bob lives in Rome and plays the violin. "
           "The secret number is 4821. Carol lives in Oslo and grows tomatoes. ") * 6
QUESTION = "What is the secret number?"


def _presses():
    K = kvpress_c
    return {
        "snapkv": K.SnapKVPress(compression_ratio=0.6),
        "adakv": K.AdaKVPress(K.SnapKVPress(compression_ratio=0.6)),
        "chunkkv_reuse": K.ChunkKVPress(K.SnapKVPress(compression_ratio=0.6), chunk_length=10, reuse_layers=2),
        "take": K.TAKEPress(budget=96, chunk_size=128),
        "think_freed": K.ThinKPress(key_channel_compression_ratio=0.5, free_channels=True),
        "decoding": K.DecodingPress(base_press=K.KnormPress(), compression_interval=4, target_size=96),
        "merging": K.MergingPress(K.KnormPress(compression_ratio=0.5)),
        "full": None,
    }


def _state(session, L, Hkv):
    """Everything a cache holds, read back: lengths, positions, rows (f32), position, bytes."""
    rows = [[session.cache_rows(l, h) for h in range(Hkv)] for l in range(L)]
    pos = [[session.cache_positions(l, h) for h in range(Hkv)] for l in range(L)]
    return session.cache_lengths(), pos, rows, session.position, session.cache_bytes


def _assert_same_cache(a, b, L, Hkv):
    la, pa, ra, qa, ba = _state(a, L, Hkv)
    lb, pb, rb, qb, bb = _state(b, L, Hkv)
    assert np.array_equal(la, lb) and qa == qb and ba == bb, (la, lb, qa, qb, ba, bb)
    for l in range(L):
        for h in range(Hkv):
            assert np.array_equal(pa[l][h], pb[l][h]), (l, h)
            assert np.array_equal(ra[l][h][0], rb[l][h][0]) and np.array_equal(ra[l][h][1], rb[l][h][1]), (l, h)


@pytest.mark.parametrize("name", list(_presses()))
def test_save_load_answers_as_the_session_that_saved(default_model, tmp_path, name):
    model, press = default_model, _presses()[name]
    cfg = model.config
    L, Hkv = cfg["n_layers"], cfg["n_kv_heads"]
    pipe = kvpress_c.Pipeline(model)
    res = pipe(CONTEXT, question=QUESTION, press=press, max_new_tokens=12)
    path = tmp_path / f"{name}.kvc"
    res.save_cache(path)
    context = res._context[0]  # the compressed context the answer started from
    loaded = kvpress_c.load_session(model, path)
    a = model.new_session(0)  # a copy: arenas sized to the rows held, as a load sizes them
    if name == "decoding":
        a.set_decoding_press(**press.decoding_config())
    a.copy_cache_from(context)
    _assert_same_cache(a, loaded, L, Hkv)
    if name == "think_freed":  # freed channels: fewer bytes than the same rows with every channel
        assert loaded.cache_bytes < 2 * 4 * cfg["head_dim"] * int(loaded.cache_lengths().sum())
    info = kvpress_c.cache_info(path)
    assert info["prompt_ids"] == list(pipe.split_prompt(CONTEXT, QUESTION)[0])
    assert (info.get("decoding_press") is not None) == (name == "decoding")
    # the question's logits from the saved session (its copy) and from the reloaded one, presses as attached
    q = np.asarray(pipe.split_prompt(CONTEXT, QUESTION)[1], dtype=np.int32)
    la, lb = a.forward(q, logits="all"), loaded.forward(q, logits="all")
    assert np.abs(la - lb).max() <= 1e-6  # bit-equal caches: measured 0.0
    again = pipe(question=QUESTION, cache=path, max_new_tokens=12)
    assert again.answers == res.answers
    assert again.stats["prefill_s"] == 0.0 and again.stats["kept_tokens"] == res.stats["kept_tokens"]


def test_cache_answers_several_questions_and_checks_the_context(default_model, tmp_path):
    pipe = kvpress_c.Pipeline(default_model)
    qs = [QUESTION, "Where does Bob live?"]
    ref = pipe(CONTEXT, questions=qs, press=kvpress_c.SnapKVPress(compression_ratio=0.5), max_new_tokens=10)
    ref.save_cache(tmp_path / "c.kvc")
    assert pipe(CONTEXT, questions=qs, cache=tmp_path / "c.kvc", max_new_tokens=10).answers == ref.answers
    with pytest.raises(ValueError, match="not the one the cache"):
        pipe("Another context entirely.", question=QUESTION, cache=tmp_path / "c.kvc")
    aware = pipe(CONTEXT, question=QUESTION, press=kvpress_c.SnapKVPress(compression_ratio=0.5), query_aware=True,
                 max_new_tokens=4)
    with pytest.raises(ValueError, match="no question-free cache"):
        aware.save_cache(tmp_path / "x.kvc")


def test_file_digest_matches_hashlib_and_safetensors_reads_it(default_model, tmp_path):
    from safetensors.numpy import load_file
    s = default_model.new_session(0)
    s.set_press(**kvpress_c.SnapKVPress(compression_ratio=0.5).c_config())
    s.forward(np.asarray(default_model.encode(CONTEXT), dtype=np.int32), logits="last")
    path = str(tmp_path / "s.kvc")
    s.save(path, {"note": "quotes \" and \\ and \n newline, ünïcode"})
    raw = open(path, "rb").read()
    hlen = struct.unpack("<Q", raw[:8])[0]
    meta = json.loads(raw[8:8 + hlen])["__metadata__"]
    assert meta["note"] == "quotes \" and \\ and \n newline, ünïcode"
    hexd = meta["kvc.digest"].split(":")[1]
    zeroed = raw.replace(hexd.encode(), b"0" * 64)
    assert hashlib.sha256(zeroed).hexdigest() == hexd  # the file's digest, computed independently
    assert hlen % 8 == 0
    t = load_file(path)
    L, Hkv = default_model.config["n_layers"], default_model.config["n_kv_heads"]
    for l in (0, L - 1):
        lens = t[f"layer.{l}.rows"]
        assert np.array_equal(lens, s.cache_lengths()[l])
        k, v = s.cache_rows(l, 1)
        r0 = int(lens[0])
        assert np.array_equal(t[f"layer.{l}.keys"][r0:r0 + lens[1]], k)
        assert np.array_equal(t[f"layer.{l}.values"][r0:r0 + lens[1]], v)
        assert np.array_equal(t[f"layer.{l}.positions"][r0:r0 + lens[1]], s.cache_positions(l, 1))


def test_model_digest_is_sha256_of_the_weight_files(default_model, tmp_path, rng):
    with open(default_model.path, "rb") as f:
        want = hashlib.sha256(f.read()).hexdigest()
    assert _core.model_digest(default_model._core) == "sha256:" + want
    folder = write_random_llama(str(tmp_path / "m"), layers=1, hidden=64, heads=2, kv_heads=1, ffn=64, vocab=64,
                                seed=int(rng.integers(1 << 30)))
    m = kvpress_c.load_model(folder, weights="fp32")
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        assert _core.model_digest(m._core) == "sha256:" + hashlib.sha256(f.read()).hexdigest()


# -- refusals -----------------------------------------------------------------------------------------------

def _tiny(folder, seed, layers=2):
    return kvpress_c.load_model(write_random_llama(folder, layers=layers, hidden=64, heads=4, kv_heads=2, ffn=64,
                                                   vocab=64, seed=seed), weights="fp32")


def _saved(model, path, rng, n=40):
    s = model.new_session(0)
    s.set_press(**kvpress_c.SnapKVPress(compression_ratio=0.5, window_size=4).c_config())
    s.forward(rng.integers(3, 64, n).astype(np.int32), logits="last")
    s.set_press(None)
    s.save(str(path))
    return s


def _rewrite_meta(path, out, **changes):
    """The file with metadata changed (a value None: the key removed) and its digest recomputed (a well-formed file
    that says something else)."""
    raw = open(path, "rb").read()
    hlen = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + hlen])
    hdr["__metadata__"].update(changes)
    hdr["__metadata__"] = {k: v for k, v in hdr["__metadata__"].items() if v is not None}
    hdr["__metadata__"]["kvc.digest"] = "sha256:" + "0" * 64
    body = json.dumps(hdr).encode()
    body += b" " * (-len(body) % 8)
    blob = struct.pack("<Q", len(body)) + body + raw[8 + hlen:]
    d = hashlib.sha256(blob).hexdigest()
    open(out, "wb").write(blob.replace(b"0" * 64, d.encode(), 1))


def test_refusals_say_which(tmp_path, rng):
    seed = int(rng.integers(1 << 30))
    print("model seed", seed)
    a = _tiny(str(tmp_path / "a"), seed)
    path = tmp_path / "a.kvc"
    src = _saved(a, path, rng)
    ok = a.new_session(0)
    ok.load(str(path))
    assert np.array_equal(ok.cache_lengths(), src.cache_lengths())
    with pytest.raises(ValueError, match="needs an empty session"):
        ok.load(str(path))
    with pytest.raises(ValueError, match="different model: n_layers is 2 in the file, 3"):
        _tiny(str(tmp_path / "b"), seed, layers=3).new_session(0).load(str(path))
    with pytest.raises(ValueError, match="different model: its weights' digest"):
        _tiny(str(tmp_path / "c"), seed + 1).new_session(0).load(str(path))
    _rewrite_meta(path, tmp_path / "v4.kvc", **{"kvc.version": "4"})
    with pytest.raises(ValueError, match="format version 4, newer than this kvpress_c reads"):
        a.new_session(0).load(str(tmp_path / "v4.kvc"))
    raw = open(path, "rb").read()
    (tmp_path / "cut.kvc").write_bytes(raw[:-100])
    with pytest.raises(ValueError, match="truncated or corrupt|outside the"):
        a.new_session(0).load(str(tmp_path / "cut.kvc"))
    flipped = bytearray(raw)
    flipped[-7] ^= 0x10  # a value's byte deep in the data section
    (tmp_path / "flip.kvc").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="is corrupt: its SHA-256 digest does not match"):
        a.new_session(0).load(str(tmp_path / "flip.kvc"))
    with pytest.raises(ValueError, match="not a kvpress_c cache file"):
        a.new_session(0).load(os.path.join(str(tmp_path / "a"), "model.safetensors"))
    with pytest.raises(ValueError, match="reserved"):
        src.save(str(tmp_path / "r.kvc"), {"kvc.position": "3"})
    with pytest.raises(FileNotFoundError):
        kvpress_c.load_session(a, tmp_path / "missing.kvc")
    attached = a.new_session(0)  # a press left attached: the load needs it given again
    snap = kvpress_c.SnapKVPress(compression_ratio=0.5, window_size=4)
    attached.set_press(**snap.c_config())
    attached.forward(rng.integers(3, 64, 30).astype(np.int32), logits="last")
    attached.save(str(tmp_path / "att.kvc"))
    assert kvpress_c.cache_info(tmp_path / "att.kvc")["attached"] == ["press"]
    with pytest.raises(ValueError, match="saved with a prefill press attached"):
        kvpress_c.load_session(a, tmp_path / "att.kvc")
    assert kvpress_c.load_session(a, tmp_path / "att.kvc", press=snap).position == 30


def test_sha256_at_every_padding_boundary(tmp_path, rng):
    """The C SHA-256 (csrc/persist/sha256.c) against hashlib where its padding changes: a folder's weight digest
    covers every *.safetensors in name order, so a second file of n bytes puts the message length at each edge."""
    import shutil
    seed = int(rng.integers(1 << 30))
    folder = write_random_llama(str(tmp_path / "base"), layers=1, hidden=64, heads=2, kv_heads=1, ffn=64, vocab=64,
                                seed=seed)
    weights = open(os.path.join(folder, "model.safetensors"), "rb").read()
    base = len(weights) % 64
    for i, extra in enumerate([0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 128, int(rng.integers(1, 5000))]):
        n = (extra - base) % 64 + 64 * (i % 3)  # total length = extra (mod 64), 0-2 more blocks
        m_dir = str(tmp_path / f"m{i}")
        shutil.copytree(folder, m_dir)
        tail = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        with open(os.path.join(m_dir, "zz.safetensors"), "wb") as f:  # not read by the loader (model.safetensors is)
            f.write(tail)
        m = kvpress_c.load_model(m_dir, weights="fp32")
        assert _core.model_digest(m._core) == "sha256:" + hashlib.sha256(weights + tail).hexdigest(), (i, n)
