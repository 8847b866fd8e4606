"""The CPU decode step's kernels alone (issue 27): nanoseconds per key of the scores and the P V update on 64-key
tiles of one head (3 query rows, d = 64: SmolLM2's shape) for each storage type, and of the whole decode attention
(`attention`: kvc_cpu_attention over 3 KV heads of 3 query rows, its tasks, online softmax and merge, one thread)
for each type, f32's included (the baseline of every ratio), over a working set that stays in cache (4032 keys: the
kernels' arithmetic; "L2", though f32's 2 MB of K/V there is L2's size or more) and one of 512 MB of stored K/V,
past the last-level cache (a long context streamed from memory). The gap between the two says whether a type's step
is bound by its arithmetic or by its bytes. The kernels alone do not show everything the step does (docs/METHODS.md,
"Later (stop 45)"): kv_cache_types.py's floor share of f32's own step is the check on the baseline.

    python benchmarks/kv_step_kernels.py [--types f32 f16 bf16 q8_0 kivi4 kivi2] [--parts both scores pv attention]
                                         [--rounds 7] [--against DIR] [--out FILE]

benchmarks/native/kv_step_kernels.c is compiled here with the build's flags (setup.py: -O3 -ffp-contract=fast
-fno-math-errno -fopenmp -fPIC, -march=native unless KVC_NATIVE=0) against csrc/backend/cpu's kernels and
attention.c with what it calls; --against DIR compiles the same driver against another checkout's (a `git
worktree` of an older commit: from 48528bf on, which has weight_hint.c and the tiles' source) and runs both in
turn, so a change to a kernel is measured against its predecessor in one run (ratios: theirs / ours, > 1 faster
here). Each configuration runs --rounds times as a separate process, the builds and types taking turns (a shared
machine has slow spells lasting seconds); the table gives the minimum and the median over rounds of each process's
best pass. No Python or model is involved: this is the kernel, not the step (benchmarks/kv_cache_types.py times that).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_share import c_compiler  # noqa: E402  (the one compiler lookup of the native drivers)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TYPES = {"f32": 0, "bf16": 1, "f16": 2, "q8_0": 3, "kivi4": 4, "kivi2": 5}
# keys (cut to whole tiles in each of 3 heads; 0: 512 MB of K/V), passes a process times (its best is kept)
SETS = {"L2": (4096, 200), "memory": (0, 2)}
PARTS = {"both": 0, "scores": 1, "pv": 2, "attention": 3}  # f32 has the attention alone (no typed tiles)
KERNELS = ["csrc/backend/cpu/kv_decode.c", "csrc/backend/cpu/kv_rows_step.c", "csrc/backend/cpu/kv_kivi_step.c",
           "csrc/backend/cpu/attention.c", "csrc/backend/cpu/weight_hint.c", "csrc/backend/cpu/ukernel.c",
           "csrc/core/error.c"]


def build(root: str, out: str) -> str:
    cc = c_compiler()
    if not cc:
        sys.exit("no C compiler (cc or gcc) on PATH")
    flags = ["-D_GNU_SOURCE", "-O3", "-ffp-contract=fast", "-fno-math-errno", "-std=c11", "-fopenmp", "-fPIC"]
    if os.environ.get("KVC_NATIVE", "1") != "0":
        flags.append("-march=native")
    # this driver, against root's kernels and headers
    driver = os.path.join(HERE, "native", "kv_step_kernels.c")
    cmd = [cc, *flags, "-I", os.path.join(root, "csrc"), driver, *[os.path.join(root, k) for k in KERNELS], "-o", out, "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"compiling the kernels of {root} failed:\n{' '.join(cmd)}\n{r.stderr}")
    return out


def run_once(exe: str, t: str, keys: int, passes: int, part: str) -> float | None:
    r = subprocess.run([exe, str(TYPES[t]), str(keys), str(passes), str(PARTS[part])], capture_output=True, text=True,
                       check=True)
    f = r.stdout.split()
    return float(f[3]) if len(f) >= 5 and f[2] == part else None  # None: this build decodes such tiles instead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--against", default=None, help="another checkout whose kernels to time beside these")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kv_step_kernels.json"))
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="kvc_kernels_")
    builds = {"here": build(ROOT, os.path.join(tmp, "here"))}
    if args.against:
        builds["against"] = build(os.path.abspath(args.against), os.path.join(tmp, "against"))
    configs = [(t, s, p) for t in args.types for s in SETS for p in args.parts if t != "f32" or p == "attention"]
    times: dict = {b: {c: [] for c in configs} for b in builds}
    for rnd in range(args.rounds):
        print(f"round {rnd + 1} of {args.rounds} ...", file=sys.stderr, flush=True)
        for c in configs:
            for b, exe in builds.items():
                times[b][c].append(run_once(exe, c[0], SETS[c[1]][0], SETS[c[1]][1], c[2]))

    def summary(v):
        v = [x for x in v if x is not None]
        return {"min": min(v), "median": statistics.median(v)} if v else None

    res = {b: {f"{t}/{s}/{p}": summary(times[b][(t, s, p)]) for (t, s, p) in configs} for b in builds}
    info = {"machine": platform.machine(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
            "rounds": args.rounds, "sets": {k: {"keys": v[0], "passes": v[1]} for k, v in SETS.items()},
            "shape": {"d": 64, "query_rows": 3, "tile": 64, "attention_kv_heads": 3}, "against": args.against}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"info": info, "ns_per_key": res}, f, indent=1)

    print(f"\nns per key, min (median) of {args.rounds} processes; d 64, 3 query rows, 64-key tiles; "
          f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}\n")
    cols = [f"{s} {p}" for s in SETS for p in args.parts]
    print("| type | build | " + " | ".join(cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    for t in args.types:
        for b in builds:
            cells = []
            for s in SETS:
                for p in args.parts:
                    if f"{t}/{s}/{p}" not in res[b]:  # f32's typed-tile parts: it has none
                        cells.append("-")
                        continue
                    r = res[b][f"{t}/{s}/{p}"]
                    cell = "decoded" if r is None else f"{r['min']:.2f} ({r['median']:.2f})"
                    if b == "here" and "against" in res and r and res["against"][f"{t}/{s}/{p}"]:
                        cell += f" x{res['against'][f'{t}/{s}/{p}']['min'] / r['min']:.2f}"
                    cells.append(cell)
            print(f"| {t} | {b} | " + " | ".join(cells) + " |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
