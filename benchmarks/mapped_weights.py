"""Native weights three ways: the default (Q4_0/Q4_1/Q8_0 copied into the CPU's interleaved decode layout,
the rest used in place in the mapped file), "mapped" (load_model(repack=False): every native weight in place,
in the file's layout) and "copied" (mmap=False): resident memory after load in fresh processes (RssAnon:
anonymous memory; RssFile: file pages, the shared page cache) and load seconds, then decode tok/s of the
three in one process, taking turns (a mapped q|k|v whose parts are not back to back in the file runs three
GEMVs where a copied one runs one).

    python benchmarks/mapped_weights.py [--model PATH] [--threads N] [--reps 8] [--decode-model PATH]

--model defaults to the embedded SmolLM2-135M Q4_1. Writes benchmarks/results/mapped_weights.json. The
8B-shaped figures (mapped_weights_8b.json): write the file with tests/support/random_llama.py's
write_llama31_gguf(path, "Q4_0") (4.5 GB), then --model path --no-decode --out .../mapped_weights_8b.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import json, sys, time
import kvpress_c
def status():
    out = {}
    for line in open('/proc/self/status'):
        k, _, v = line.partition(':')
        if k in ('VmRSS', 'RssAnon', 'RssFile'):
            out[k] = int(v.split()[0]) * 1024
    return out
before = status(); t0 = time.perf_counter()
m = kvpress_c.load_model(sys.argv[1], mmap=sys.argv[2] == '1', repack=sys.argv[3] == '1')
load_s = time.perf_counter() - t0
after = status()
print(json.dumps({'load_s': load_s, 'memory': m.memory(), **{k: after[k] - before[k] for k in after}}))
"""


# name -> load_model keywords
MODES = {"default": dict(mmap=True, repack=True), "mapped": dict(mmap=True, repack=False), "copied": dict(mmap=False, repack=True)}


def fresh_load(path: str, mmap: bool, repack: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PROBE, path, "1" if mmap else "0", "1" if repack else "0"],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def decode_ab(path: str, threads: int, reps: int, prompt: int = 256, steps: int = 64) -> dict:
    import kvpress_c
    kvpress_c._core.set_num_threads(threads)
    models = {k: kvpress_c.load_model(path, **kw) for k, kw in MODES.items()}
    ids = np.random.default_rng(0).integers(300, models["default"].config["vocab"] - 100, prompt + steps).astype(np.int32)
    tok_s = {k: [] for k in models}
    for _ in range(reps):
        for k, m in models.items():
            s = m.new_session(prompt + steps)
            s.forward(ids[:prompt], logits="last")
            dt = []
            for i in range(steps):
                t0 = time.perf_counter()
                s.forward(ids[prompt + i:prompt + i + 1], logits="last")
                dt.append(time.perf_counter() - t0)
            tok_s[k].append(1 / float(np.median(dt)))
    return tok_s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2-135M Q4_1)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--no-decode", action="store_true", help="memory only (large models)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "mapped_weights.json"))
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    import kvpress_c
    path = args.model or kvpress_c.default_model_path()
    size = os.path.getsize(path) if os.path.isfile(path) else sum(
        os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    result = {"model": path, "file_bytes": size, "threads": args.threads, "load": {}}
    print(f"{path} ({size / 1e6:.1f} MB of weights files), fresh process after load:")
    print(f"{'':<8}{'load s':>8}{'RSS MB':>9}{'RssAnon MB':>12}{'RssFile MB':>12}{'weights MB':>12}{'mapped MB':>11}")
    for key, kw in MODES.items():
        r = fresh_load(path, **kw)
        result["load"][key] = r
        print(f"{key:<8}{r['load_s']:>8.2f}{r['VmRSS'] / 1e6:>9.1f}{r['RssAnon'] / 1e6:>12.1f}{r['RssFile'] / 1e6:>12.1f}"
              f"{r['memory']['weights'] / 1e6:>12.1f}{r['memory']['mapped'] / 1e6:>11.1f}")
    if not args.no_decode:
        tok_s = decode_ab(path, args.threads, args.reps)
        result["decode_tok_s"] = tok_s
        for k, v in tok_s.items():
            print(f"decode {k}: median {np.median(v):.1f} tok/s over {len(v)} interleaved reps "
                  f"({' '.join(f'{x:.1f}' for x in v)}), {args.threads} threads")
    result["command"] = "python benchmarks/mapped_weights.py " + " ".join(argv if argv is not None else sys.argv[1:])
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
