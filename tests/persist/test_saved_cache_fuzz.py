"""The saved-cache reader against damaged files (in a subprocess: a crash must fail the test, not kill pytest):
every truncation of a file and thousands of random byte flips are refused with a ValueError, and the session
they were loaded into stays empty. The file holds every kind of tensor: ragged evicted heads, ThinK's freed
channels and a decoding press's state mid-answer (its counters, buffered calls and queries), loaded into a
session with that press attached so the state's reader runs too."""
import os
import subprocess
import sys
import textwrap

import kvpress_c
from random_llama import write_random_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kvpress_c.__file__)))

FUZZ = textwrap.dedent(r'''
    import os, random, sys
    import numpy as np
    import kvpress_c
    folder, work, seed, n_flips = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    m = kvpress_c.load_model(folder, weights="fp32")
    s = m.new_session(0)
    # a cache with every kind of tensor: evicted ragged heads (Ada-KV) and ThinK's freed channels
    s.set_press(**kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(compression_ratio=0.5, window_size=4)).c_config())
    think = kvpress_c.ThinKPress(key_channel_compression_ratio=0.5, window_size=4)
    ids = np.asarray([rng.randrange(3, 64) for _ in range(30)], dtype=np.int32)
    s.forward(ids, logits="last")
    s.set_press(**think.c_config())
    think.before_prefill(s, 8, m.config)
    s.forward(np.asarray([rng.randrange(3, 64) for _ in range(8)], dtype=np.int32), logits="last")
    s.set_press(None)
    dec = kvpress_c.DecodingPress(kvpress_c.SnapKVPress(window_size=4), compression_interval=6, target_size=24,
                                  hidden_states_buffer_size=6).decoding_config()
    s.set_decoding_press(**dec)  # mid-answer: one compression behind, two steps buffered
    for _ in range(8):
        s.forward(np.asarray([rng.randrange(3, 64)], dtype=np.int32), logits="last")
    src = os.path.join(work, "src.kvc")
    s.save(src, {"prompt_ids": "[1, 2, 3]"})
    data = open(src, "rb").read()
    names = kvpress_c.cache_info(src)
    import json, struct
    hdr = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
    assert any(k.endswith("key_channels") for k in hdr), "the cache has no freed channels to fuzz"
    assert "state.decoding.queries" in hdr and "state.decoding.entries" in hdr, "the file holds no decoding state"

    def attempt(blob, i):
        p = os.path.join(work, f"c{i % 3}.kvc")
        with open(p, "wb") as f:
            f.write(blob)
        t = m.new_session(0)
        t.set_decoding_press(**dec)
        try:
            t.load(p)
        except ValueError as e:
            assert len(str(e)) > 20, (i, str(e))
            assert t.position == 0 and int(t.cache_lengths().sum()) == 0, i
            if i % 7 == 0:  # the metadata reader refuses it too
                try:
                    kvpress_c.cache_info(p)
                    raise AssertionError(f"case {i}: cache_info read a file load refused")
                except ValueError:
                    pass
            return str(e).split(":")[-1][:40]
        raise AssertionError(f"case {i}: a damaged file loaded")

    kinds = {}
    for cut in range(len(data)):  # every truncation
        attempt(data[:cut], cut)
    for i in range(n_flips):  # 1-4 bytes changed anywhere: header length, JSON, digest, data
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            p = rng.randrange(len(b))
            b[p] = (b[p] + rng.randrange(1, 256)) % 256
        why = attempt(bytes(b), len(data) + i)
        kinds[why] = kinds.get(why, 0) + 1
    t = m.new_session(0)
    t.set_decoding_press(**dec)
    t.load(src)  # and the undamaged file still loads, equal, and goes on as the session that saved it
    assert np.array_equal(t.cache_lengths(), s.cache_lengths()) and t.cache_bytes <= s.cache_bytes
    for tok in (5, 9, 13):
        a = s.forward(np.asarray([tok], dtype=np.int32), logits="last")
        assert np.array_equal(a, t.forward(np.asarray([tok], dtype=np.int32), logits="last"))
    print(f"{len(data)} truncations and {n_flips} flips (seed {seed}) refused; reasons: {len(kinds)}")
''')


def test_fuzz_saved_cache_never_crashes(tmp_path, rng):
    seed = int(rng.integers(1 << 30))
    folder = write_random_llama(str(tmp_path / "m"), layers=2, hidden=64, heads=4, kv_heads=2, ffn=64, vocab=64,
                                seed=seed)
    script = tmp_path / "fuzz.py"
    script.write_text(FUZZ)
    work = tmp_path / "w"
    work.mkdir()
    n = 3000
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(script), folder, str(work), str(seed), str(n)], capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, f"fuzzer failed (seed {seed}): rc={res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    print(res.stdout)
    assert f"and {n} flips (seed {seed}) refused" in res.stdout
