"""The loaders' fuzzers, shared by the format and family tests: each runs in a subprocess (a crash fails the test,
not pytest) over a base file the caller writes, and every case must load or be refused with a status and a message.

- run_gguf_fuzz: corruptions of a GGUF file (truncations, bit flips, lies in its counts, lengths, dimensions, types
  and offsets, and in the values of its own metadata keys: `{arch}.*` as the family reads them), from its Layout
  (gguf_writer: GGUFFile.write's, or gguf_layout of any file).
- run_config_fuzz: random values (wrong types, out of range, absent) in a Hugging Face folder's config.json keys the
  caller names (a family's own)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

GGUF_FUZZ = textwrap.dedent(r"""
    import ctypes, json, os, random, struct, sys
    lib = ctypes.CDLL(sys.argv[1]); lib.kvc_last_error.restype = ctypes.c_char_p
    lib.kvc_model_load.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.kvc_model_free.argtypes = [ctypes.c_void_p]
    data = open(sys.argv[2], 'rb').read(); out = sys.argv[3]; seed = int(sys.argv[4]); n = int(sys.argv[5])
    lay = json.load(open(sys.argv[6]))
    fields, info_end = [f for f in lay['fields'] if f['kind'] != 'value'], lay['info_end']
    arch = lay.get('arch') or ''
    values = [f for f in lay['fields'] if f['kind'] == 'value' and f['owner'].startswith(arch + '.')]
    rng = random.Random(seed)
    LIES8 = [0, 1, 2, 7, 31, 32, 33, 255, 4096, 2**31, 2**32, 2**32 + 5, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
    LIES4 = [0, 1, 2, 3, 4, 5, 8, 9, 12, 13, 14, 15, 16, 30, 31, 40, 63, 64, 255, 2**31, 2**32 - 1]
    FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-30, 1e30, 3.4e38, float('inf'), float('-inf'), float('nan'), -1e-6, 1e6]
    KINDS = ['truncate', 'bitflip', 'field', 'field', 'u64', 'u32', 'bytes', 'splice'] + (['value', 'value'] if values else [])
    ok = failed = 0
    kinds = {}
    api = None
    if len(sys.argv) > 7:
        sys.path.insert(0, sys.argv[7]); import kvpress_c; api = kvpress_c.load_model
    for i in range(n):
        b = bytearray(data)
        kind = KINDS[i % len(KINDS)]
        if kind == 'truncate':    # cut anywhere, weighted towards the header
            b = b[:rng.randrange(0, info_end + 64) if rng.random() < 0.7 else rng.randrange(0, len(b))]
        elif kind == 'bitflip':   # a few bit flips in the header / metadata / tensor infos
            for _ in range(rng.randint(1, 4)):
                p = rng.randrange(0, info_end); b[p] ^= 1 << rng.randrange(8)
        elif kind == 'field':     # a lie in a specific count, length, dim, type or offset
            f = rng.choice(fields)
            v = rng.choice(LIES8 if f['size'] == 8 else LIES4)
            if rng.random() < 0.3:
                v = (int.from_bytes(b[f['pos']:f['pos'] + f['size']], 'little') + rng.choice([-1, 1, 32, -32])) % (1 << (8 * f['size']))
            b[f['pos']:f['pos'] + f['size']] = (v % (1 << (8 * f['size']))).to_bytes(f['size'], 'little')
            kind = 'field:' + f['kind']
        elif kind == 'value':     # a lie in the value of one of the architecture's own keys
            f = rng.choice(values)
            if f['vtype'] in (6, 12):  # f32, f64
                b[f['pos']:f['pos'] + f['size']] = struct.pack('<f' if f['size'] == 4 else '<d', rng.choice(FLOATS))
            else:
                v = rng.choice(LIES8 + LIES4 + [-1, -2, 2**15, 2**16]) % (1 << (8 * f['size']))
                if rng.random() < 0.4:
                    v = (int.from_bytes(b[f['pos']:f['pos'] + f['size']], 'little') + rng.choice([-1, 1, 2, -2])) % (1 << (8 * f['size']))
                b[f['pos']:f['pos'] + f['size']] = v.to_bytes(f['size'], 'little')
        elif kind == 'u64':       # a lying 64-bit value at any header position
            p = rng.randrange(0, info_end - 8); b[p:p + 8] = struct.pack('<Q', rng.choice(LIES8))
        elif kind == 'u32':
            p = rng.randrange(0, info_end - 4); b[p:p + 4] = struct.pack('<I', rng.choice(LIES4))
        elif kind == 'bytes':     # random bytes over a random span
            p = rng.randrange(0, len(b)); L = rng.randint(1, 64)
            b[p:p + L] = bytes(rng.randrange(256) for _ in range(min(L, len(b) - p)))
        else:                     # a chunk of the header duplicated or removed
            p = rng.randrange(0, info_end); L = rng.randint(1, 48)
            b = b[:p] + (b[p:p + L] if rng.random() < 0.5 else b'') + b[p + L:]
        kinds[kind.split(':')[0]] = kinds.get(kind.split(':')[0], 0) + 1
        open(out, 'wb').write(b)
        m = ctypes.c_void_p()
        st = lib.kvc_model_load(out.encode(), ctypes.byref(m))
        if st == 0:
            ok += 1; lib.kvc_model_free(m)
        else:
            failed += 1
            msg = lib.kvc_last_error().decode(errors='replace')
            assert msg and not m.value, f'corruption {i} ({kind}): status {st} without a message'
            assert st in (1, 2, 3, 4, 5), f'corruption {i} ({kind}): status {st}: {msg}'
        if api and i % 4 == 0:
            try:
                api(out)
            except (ValueError, OSError, NotImplementedError, MemoryError) as e:
                assert str(e), f'corruption {i}: {type(e).__name__} without a message'
    print(f'{n} corruptions (seed {seed}): {failed} rejected with a message, {ok} loaded; kinds {kinds}')
""")


def _run(tmp_path, script: str, args: list, seed: int, n: int, what: str) -> str:
    from kvpress_c._paths import core_library_path
    path = tmp_path / "fuzz.py"
    path.write_text(script)
    res = subprocess.run([sys.executable, str(path), core_library_path(), *map(str, args)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, f"fuzzer failed (seed {seed}): rc={res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert f"{n} {what} (seed {seed})" in res.stdout, res.stdout
    return res.stdout.strip()


def run_gguf_fuzz(tmp_path, base: str, layout, seed: int, n: int = 1000, arch: str = "", python_api: bool = True) -> str:
    """Corruptions of GGUF file `base` (its Layout `layout`; `arch`: whose `{arch}.*` values to lie about, "" none)."""
    import kvpress_c
    lay = tmp_path / "layout.json"
    lay.write_text(json.dumps({"fields": [vars(f) for f in layout.fields], "info_end": layout.info_end, "arch": arch}))
    pkg_root = os.path.dirname(os.path.dirname(kvpress_c.__file__))
    args = [base, tmp_path / "bad.gguf", seed, n, lay] + ([pkg_root] if python_api else [])
    return _run(tmp_path, GGUF_FUZZ, args, seed, n, "corruptions")


CONFIG_FUZZ = r'''
import ctypes, json, os, random, sys
lib = ctypes.CDLL(sys.argv[1]); lib.kvc_last_error.restype = ctypes.c_char_p
lib.kvc_model_load.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
lib.kvc_model_free.argtypes = [ctypes.c_void_p]
folder, seed, n = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
spec = json.load(open(sys.argv[5]))
KEYS, VALUES = spec['keys'], spec['values']
rng = random.Random(seed)
path = os.path.join(folder, 'config.json')
BASE = json.load(open(path))
counts = {'loaded': 0, 'rejected': 0}
for i in range(n):
    cfg = json.loads(json.dumps(BASE))
    for _ in range(rng.randint(1, 3)):
        k = rng.choice(KEYS)
        if rng.random() < 0.15:
            cfg.pop(k, None)
        else:
            cfg[k] = rng.choice(VALUES)
    json.dump(cfg, open(path, 'w'))
    m = ctypes.c_void_p()
    st = lib.kvc_model_load(folder.encode(), ctypes.byref(m))
    if st == 0:
        counts['loaded'] += 1; lib.kvc_model_free(m)
    else:
        counts['rejected'] += 1
        msg = lib.kvc_last_error()
        assert 1 <= st <= 7 and not m.value, (i, cfg, st)
        assert msg and len(msg) > 10, f'case {i}: status {st} without a message'
json.dump(BASE, open(path, 'w'))
print(f"{n} configs (seed {seed}): {counts['rejected']} rejected with a message, {counts['loaded']} loaded")
'''

# values of every JSON kind, in and out of any range a key takes, for run_config_fuzz
CONFIG_VALUES = [0, -1, 1, 2, 3, 7, 2**31, 2**63, 1e300, -1e-300, 0.5, "x", "", None, True, False, [], [1, 2], {}, {"a": 1}]


def run_config_fuzz(tmp_path, folder: str, keys: list, values: list, seed: int, n: int = 300) -> str:
    """Random values of `values` (or the key removed) in 1 to 3 of `keys` of the folder's config.json, n times; the
    file is put back after."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"keys": keys, "values": values}))
    return _run(tmp_path, CONFIG_FUZZ, [folder, seed, n, spec], seed, n, "configs")
