"""The K/V cache's storage types side by side (issue 27): bytes per token, decode and prefill speed.

    python benchmarks/kv_cache_types.py [--contexts 2048 8192 32768] [--steps 8] [--settle 2] [--repeat 5] [--threads 1]
                                        [--prefill 2048 8192] [--types f32 f16 bf16 q8_0 kivi4 kivi2]
                                        [--cache-dir DIR] [--out FILE]

Model: the embedded default (SmolLM2-135M Q4_1: 30 layers, 3 KV heads of 64), native weights.
Decode: for each context n, one f32 prefill of n random tokens (saved in --cache-dir and reused by later
runs) is loaded into a session of each type (Session.load(path, kv_format=...) stores the rows in the type as a prefill's
commit does), then runs of --steps single-token steps, the types taking turns run by run and the cache cut
back to its n rows after each run: tokens per CPU-second (process time, as benchmarks/decode_cpu_time.py:
less sensitive to other jobs on a shared machine) and per wall-second; min and median over --repeat runs,
and each type's speed over f32's in the same turn (median of those ratios). Each step is timed alone: the
settled figures leave out a run's first --settle steps, which find the caches as the previous type's run left
them (a user of one type never sees that), and each run's step times are kept in the JSON. 32768 tokens exceed
SmolLM2's trained context (8192): the engine does not refuse positions past it (they are untrained), and a
step's work does not depend on the values, so the same model is measured there.
Bytes: Session.cache_bytes over tokens and layers (K/V rows, their int64 positions, and KIVI's rows waiting
in f32), against the rows' formula (core/kv_type.h).
Prefill: tokens per CPU-second of one prefill of each --prefill length into an empty session of each type
(the call's own rows are read exact; the types differ in the commit that stores them), types taking turns.
Bytes' floor: after each context's runs, memory_share's synthetic step over each type's bytes a step (the weights
and the K/V rows a step reads, nothing computed): the ratio to f32's that the bytes alone allow on this machine
now, and the share of it each type's measured ratio reaches (one thread only: the floor is one thread's stream).
Machine: benchmarks/memory_share.py's probe before and after (the weights' stream alone and with K/V between the
layers, GB/s: how much cache and bandwidth the host lends now, which moves the ratios more than the code does).
Writes JSON (default benchmarks/results/kv_cache_types.json) and prints the tables as markdown.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory_share  # noqa: E402  (benchmarks/memory_share.py: the machine's state, recorded with the figures)
# a shared machine: OpenMP threads that spin long while waiting starve the other jobs, and PASSIVE wakes sleeping
# threads at every parallel region: a short spin, then sleep (as the tests set: tests/conftest.py)
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

TYPES = ["f32", "f16", "bf16", "q8_0", "kivi4", "kivi2"]


def kv_cache(name):
    import kvpress_c
    return kvpress_c.QuantizedCache(int(name[4])) if name.startswith("kivi") else name


def row_bytes(name: str, d: int, group: int = 64) -> float:
    """Bytes of one key row plus one value row of d channels (core/kv_type.h): KIVI keys are blocks of
    `group` rows (f16 scale and min per channel, then the codes), values groups of min(group, d) channels."""
    if name in ("f32", "f16", "bf16"):
        return 2 * d * {"f32": 4, "f16": 2, "bf16": 2}[name]
    if name == "q8_0":
        return 2 * -(-d // 32) * 34
    bits, g = int(name[4]), min(group, d)
    key = (4 * d + group * d * bits / 8) / group
    value = d // g * (4 + g * bits / 8)
    return key + value


def ids_for(vocab: int, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(100, vocab - 100, size=n).astype(np.int32)


def prefilled(model, path: str, n: int, cache_dir: str, threads: int) -> str:
    """A saved f32 cache of n random tokens (made once: a prefill of n tokens, on all cores)."""
    import kvpress_c
    from kvpress_c.saved import FORMAT_VERSION
    tag = hashlib.sha256(f"{os.path.abspath(path)}:{os.path.getsize(path)}:{n}:{FORMAT_VERSION}".encode()).hexdigest()[:12]
    out = os.path.join(cache_dir, f"kv_cache_types_{n}_{tag}.kvc")
    if os.path.exists(out):
        return out
    os.makedirs(cache_dir, exist_ok=True)
    print(f"prefill of {n} tokens (f32, saved to {out}) ...", file=sys.stderr, flush=True)
    kvpress_c._core.set_num_threads(os.cpu_count())
    s = model.new_session(n + 1, kv_cache="f32")
    s.forward(ids_for(model.config["vocab"], n), logits="last")
    s.save(out + ".part")
    os.replace(out + ".part", out)
    kvpress_c._core.set_num_threads(threads)
    return out


def decode_table(model, path, n, types, args):
    from kvpress_c.kv_cache import kv_format
    saved = prefilled(model, path, n, args.cache_dir, args.threads)
    layers, vocab = model.config["n_layers"], model.config["vocab"]
    steps = ids_for(vocab, args.steps + 1, seed=1)
    sessions, out = {}, {}
    for t in types:
        s = model.new_session(0)
        s.load(saved, kv_format=kv_format(kv_cache(t)))  # the f32 rows stored in type t; a load reserves no room
        assert s.kv_format() == kv_format(kv_cache(t)), (t, s.kv_format())
        out[t] = {"cache_bytes": s.cache_bytes, "bytes_per_token_layer": s.cache_bytes / n / layers,
                  "cpu_tok_s": [], "wall_tok_s": [], "settled_tok_s": [], "step_ms": []}
        s.forward(steps[:1], logits="last")  # warm: the first step after a load grows the arena
        s.truncate(s.cache_lengths() - 1, n)
        sessions[t] = s
    for _ in range(args.repeat):
        for t in types:
            s = sessions[t]
            lens = s.cache_lengths().copy()
            cpu = []  # each step's CPU seconds: the turn's first steps find the caches as the previous type left them
            w0 = time.perf_counter()
            for i in range(args.steps):
                c0 = time.process_time()
                s.forward(steps[1 + i:2 + i], logits="last")
                cpu.append(time.process_time() - c0)
            w = time.perf_counter() - w0
            out[t]["cpu_tok_s"].append(args.steps / sum(cpu))
            out[t]["wall_tok_s"].append(args.steps / w)
            out[t]["settled_tok_s"].append((args.steps - args.settle) / sum(cpu[args.settle:]))
            out[t]["step_ms"].append([round(1e3 * c, 3) for c in cpu])
            s.truncate(lens, n)
    for t in types:
        r = out[t]
        r["cpu_min"], r["cpu_median"] = min(r["cpu_tok_s"]), float(np.median(r["cpu_tok_s"]))
        r["wall_median"] = float(np.median(r["wall_tok_s"]))
        r["settled_median"] = float(np.median(r["settled_tok_s"]))
        if "f32" in out:  # each run against f32's run of the same turn
            r["x_f32"] = float(np.median(np.array(r["cpu_tok_s"]) / np.array(out["f32"]["cpu_tok_s"])))
            r["x_f32_settled"] = float(np.median(np.array(r["settled_tok_s"]) / np.array(out["f32"]["settled_tok_s"])))
    del sessions
    return out


def bytes_floor(table: dict, n: int, cfg: dict, exe: str) -> None:
    """Beside each type's measured step: benchmarks/memory_share.py's synthetic step over the same bytes (the
    model's weights, which a step reads whole, and the K/V rows: the store's bytes less the int64 positions,
    which the attention does not read), nothing computed: floor_ms, the ratio to f32's those bytes allow now
    (bytes_ceiling), and the share of it the measured ratio reaches (of_ceiling)."""
    mb = {t: (r["bytes_per_token_layer"] - 8 * cfg["n_kv_heads"]) * n * cfg["n_layers"] / 2**20
          for t, r in table.items()}
    floors = memory_share.floor_ms(exe, mb, weights_mb=cfg["weight_bytes"] / 2**20)
    for t, r in table.items():
        r["kv_mb_a_step"], r["floor_ms"] = mb[t], floors[t]
        if "f32" in table:
            r["bytes_ceiling"] = floors["f32"] / floors[t]
            r["of_ceiling"] = r["x_f32"] / r["bytes_ceiling"]


def prefill_table(model, n, types, args):
    ids = ids_for(model.config["vocab"], n, seed=2)
    sessions = {t: model.new_session(n, kv_cache=kv_cache(t)) for t in types}
    out = {t: {"cpu_tok_s": []} for t in types}
    for _ in range(args.repeat):
        for t in types:
            s = sessions[t]
            s.reset()
            c0 = time.process_time()
            s.forward(ids, logits="last")
            out[t]["cpu_tok_s"].append(n / (time.process_time() - c0))
    for t in types:
        r = out[t]
        r["cpu_min"], r["cpu_median"] = min(r["cpu_tok_s"]), float(np.median(r["cpu_tok_s"]))
        if "f32" in out:
            r["x_f32"] = float(np.median(np.array(r["cpu_tok_s"]) / np.array(out["f32"]["cpu_tok_s"])))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per run")
    ap.add_argument("--settle", type=int, default=2, help="steps at the start of each run left out of the settled figures")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill", type=int, nargs="*", default=[2048], help="prefill lengths (none: skip)")
    ap.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "kvc_bench_caches"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "kv_cache_types.json"))
    args = ap.parse_args(argv)
    if not 0 <= args.settle < args.steps:
        ap.error(f"--settle must leave steps to time: 0 <= settle < steps (got settle {args.settle}, steps {args.steps})")
    import kvpress_c
    path = args.model or kvpress_c.default_model_path()
    model = kvpress_c.load_model(path)
    kvpress_c._core.set_num_threads(args.threads)
    cfg = model.config
    d = cfg["head_dim"]
    load0 = os.getloadavg()
    share = memory_share.build()  # the machine's state, before and after (None without a C compiler)
    share0 = memory_share.probe(exe=share) if share else None
    res = {"model": os.path.basename(path), "layers": cfg["n_layers"], "kv_heads": cfg["n_kv_heads"], "head_dim": d,
           "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": args.threads,
           "steps": args.steps, "settle": args.settle, "repeat": args.repeat, "formula_bytes_per_token_layer":
           {t: cfg["n_kv_heads"] * row_bytes(t, d) for t in args.types}, "decode": {}, "prefill": {}}
    for n in args.contexts:
        print(f"decode at {n} tokens of context ...", file=sys.stderr, flush=True)
        res["decode"][str(n)] = decode_table(model, path, n, args.types, args)
        if share and args.threads == 1:  # the floor is one thread's stream: set beside one thread's steps
            bytes_floor(res["decode"][str(n)], n, cfg, share)
    for n in args.prefill:
        print(f"prefill of {n} tokens ...", file=sys.stderr, flush=True)
        res["prefill"][str(n)] = prefill_table(model, n, args.types, args)
    res["load_average"] = [load0, os.getloadavg()]
    res["memory_share"] = [share0, memory_share.probe(exe=share) if share else None]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print_tables(res)
    print(f"wrote {args.out}")


def print_tables(res):
    types = list(res["formula_bytes_per_token_layer"])
    ctx = list(res["decode"])
    print(f"\n{res['model']}: {res['layers']} layers, {res['kv_heads']} KV heads of {res['head_dim']}; "
          f"{res['machine']}, {res['cores']} cores, {res['threads']} thread(s); load average "
          f"{res['load_average'][0][0]:.1f} -> {res['load_average'][1][0]:.1f}\n")
    if res.get("memory_share") and all(res["memory_share"]):
        print("Weights' stream, GB/s before -> after (benchmarks/memory_share.py): "
              + "; ".join(f"{k} {res['memory_share'][0][k]['weights_gbs']:.1f} -> {res['memory_share'][1][k]['weights_gbs']:.1f}"
                          for k in res["memory_share"][0]) + "\n")
    print("| type | K/V bytes per token per layer (formula) | measured, store (with positions, KIVI's f32 residual) |"
          + "".join(f" at {n} |" for n in ctx[1:]))
    print("|---|---:|---:|" + "---:|" * len(ctx[1:]))
    for t in types:
        cells = [f"{res['decode'][n][t]['bytes_per_token_layer']:.1f}" for n in ctx]
        print(f"| {t} | {res['formula_bytes_per_token_layer'][t]:.1f} | {cells[0]} (at {ctx[0]}) |"
              + "".join(f" {c} |" for c in cells[1:]))
    print(f"\nDecode, tokens per CPU-second, median of {res['repeat']} runs of {res['steps']} steps (min; x f32: "
          "median of the per-turn ratios):\n")

    def speed_cell(t, n, part="decode", digits=2):
        r = res[part][n][t]
        return f"{r['cpu_median']:.1f} ({r['cpu_min']:.1f}; x{r.get('x_f32', 1):.{digits}f})"
    by_type(types, ctx, speed_cell)
    if all("settled_median" in res["decode"][n][t] for n in ctx for t in types):
        k = res["settle"]
        print(f"\nThe same runs without each run's first {k} step{'s' if k != 1 else ''} (settled: a turn's first steps "
              "find the caches as the previous type's run left them), median (x f32: median of the per-turn ratios; "
              "first step of a run, median ms):\n")

        def settled_cell(t, n):
            r = res["decode"][n][t]
            first = float(np.median([run[0] for run in r["step_ms"]]))
            return f"{r['settled_median']:.1f} (x{r.get('x_f32_settled', 1):.2f}; first step {first:.1f} ms)"
        by_type(types, ctx, settled_cell)
    if all("floor_ms" in res["decode"][n][t] for n in ctx for t in types):
        print("\nThe bytes' floor: benchmarks/memory_share.py's synthetic step over each type's bytes a step (the "
              "weights and the K/V rows read), nothing computed; measured step ms (median) / floor ms (the floor's "
              "share of the step: f32's own is how near its baseline runs to its bytes, so a slow f32 step, which "
              "would lift every ratio, shows here); the ratio to f32 those bytes allow, and the share of it "
              "reached:\n")

        def floor_cell(t, n):
            r = res["decode"][n][t]
            step_ms = 1e3 / r["cpu_median"]
            cell = f"{step_ms:.1f} / {r['floor_ms']:.1f} ms ({100 * r['floor_ms'] / step_ms:.0f}%)"
            return cell + (f"; x{r['bytes_ceiling']:.2f} allowed, {100 * r['of_ceiling']:.0f}% of it"
                           if "bytes_ceiling" in r else "")
        by_type(types, ctx, floor_cell)
    if res["prefill"]:
        print("\nPrefill, tokens per CPU-second, median (min; x f32):\n")
        by_type(types, list(res["prefill"]), lambda t, n: speed_cell(t, n, "prefill", 3))


def by_type(types, ctx, cell):
    """A markdown table: a row per type, a column per context length, cell(type, n) in each."""
    print("| type |" + "".join(f" {n} tokens |" for n in ctx))
    print("|---|" + "---:|" * len(ctx))
    for t in types:
        print(f"| {t} |" + "".join(f" {cell(t, n)} |" for n in ctx))


if __name__ == "__main__":
    main()
