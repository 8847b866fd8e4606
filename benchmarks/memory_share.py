"""How much memory bandwidth and last-level cache this machine lends a decode step now (issue 27's figures move
with it): benchmarks/native/memory_share.c streams SmolLM2-135M's 96 MB of weights a step as decode does, alone
and with each layer's K/V between the layers (the K/V bytes of the default model at 8k tokens: kivi4 ~52 MB,
q8_0 ~100, f16 ~190, f32 ~380), and one 512 MB buffer (memory alone, past any cache). One thread, nothing
computed.

    python benchmarks/memory_share.py [--kv 0 52 100 190 380] [--rounds 3] [--out FILE]

On a shared 2-vCPU host the weights alone stream at ~27 GB/s when they fit the cache its neighbours leave and at
~13-14 GB/s, memory's rate, once any K/V streams between the layers: a typed cache's step (whose weights are half
its bytes) gains little from the cache, and its ratio to f32's moves with the neighbours
(docs/METHODS.md, "Later (stop 39)"). benchmarks/kv_cache_types.py records a probe before and after its run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WEIGHTS_MB = 96  # SmolLM2-135M Q4_1 layers (66 MB) and its Q8_0 LM head (30 MB): what a decode step reads


def c_compiler() -> str | None:
    """The C compiler the native benchmark drivers are built with (CC, else cc or gcc on PATH), or None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(out_dir: str | None = None) -> str | None:
    """The compiled driver's path, or None where this machine has no C compiler (the probe is then skipped)."""
    cc = c_compiler()
    if not cc:
        return None
    exe = os.path.join(out_dir or tempfile.mkdtemp(prefix="kvc_memshare_"), "memory_share")
    flags = ["-O3", "-std=c11"] + (["-march=native"] if os.environ.get("KVC_NATIVE", "1") != "0" else [])
    r = subprocess.run([cc, *flags, os.path.join(HERE, "native", "memory_share.c"), "-o", exe], capture_output=True,
                       text=True)
    if r.returncode:
        raise RuntimeError(f"compiling benchmarks/native/memory_share.c failed:\n{r.stderr}")
    return exe


def run_once(exe: str, weights_mb: int, kv_mb: int) -> dict:
    out = subprocess.run([exe, str(weights_mb), str(kv_mb)], capture_output=True, text=True, check=True).stdout.split()
    return {"weights_gbs": float(out[0]), "kv_gbs": float(out[1]), "step_ms": float(out[2])}


def in_turns(exe: str, cases: dict, rounds: int) -> dict:
    """{name: the median over rounds of each of run_once's figures} for cases {name: (weights MB, K/V MB)}, the
    cases taking turns round by round (a shared machine's spells last seconds)."""
    runs: dict = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (w, kv) in cases.items():
            runs[name].append(run_once(exe, w, kv))
    return {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}


def probe(kv_mbs=(0, 52, 380), rounds: int = 1, exe: str | None = None) -> dict | None:
    """{"weights alone" | "with <n> MB of K/V" | "memory (512 MB)": the median over rounds of each GB/s}; None
    without a C compiler."""
    exe = exe or build()
    if exe is None:
        return None
    cases = {f"with {kv} MB of K/V" if kv else "weights alone": (WEIGHTS_MB, kv) for kv in kv_mbs}
    cases["memory (512 MB)"] = (512, 0)
    return in_turns(exe, cases, rounds)


def floor_ms(exe: str, kv_mbs: dict, weights_mb: float = WEIGHTS_MB, rounds: int = 3) -> dict:
    """{key: the median step ms over rounds of the synthetic step with weights_mb MB of weights and kv_mbs[key] MB
    of K/V between the layers (MiB, rounded; the driver's 30 layers)}: the time a decode step's bytes alone take,
    nothing computed, the keys taking turns. benchmarks/kv_cache_types.py sets each storage type's step beside
    it: the ratio to f32's that the bytes allow on this machine now."""
    w = max(1, int(round(weights_mb)))
    med = in_turns(exe, {key: (w, max(1, int(round(mb)))) for key, mb in kv_mbs.items()}, rounds)
    return {key: m["step_ms"] for key, m in med.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", type=int, nargs="+", default=[0, 52, 100, 190, 380], help="MB of K/V a step (0: none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "memory_share.json"))
    args = ap.parse_args(argv)
    exe = build()
    if exe is None:
        sys.exit("memory_share needs a C compiler (cc or gcc on PATH, or CC)")
    res = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "load_average": os.getloadavg(), "weights_mb": WEIGHTS_MB, "rounds": args.rounds,
           "cases": probe(args.kv, args.rounds, exe)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{WEIGHTS_MB} MB of weights a step, one thread, median of {args.rounds} rounds "
          f"(load average {res['load_average'][0]:.1f}):\n")
    print("| case | weights GB/s | K/V GB/s | step ms |\n|---|---:|---:|---:|")
    for name, c in res["cases"].items():
        print(f"| {name} | {c['weights_gbs']:.1f} | {(format(c['kv_gbs'], '.1f') if c['kv_gbs'] else '-')} | {c['step_ms']:.2f} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
