"""How far a device's logits are from the CPU's (fp32) on the shapes of tests/device/test_device.py: the
measurement behind MODEL_TOL there.

For each shape and seed: a random-weight model, a 333-token prefill (all logits) and 10 decode steps,
on the CPU and on the device; max |device - cpu| / max |cpu| for the prefill and the worst decode step.
The emulated device rounds where the CUDA backend rounds (bf16 weights, activations, cache), so on a
machine without a GPU this measures the bf16 storage itself; with --device cuda, the GPU.

    python benchmarks/device_tolerance.py [--device emulated] [--seeds 20] [--out results/device_tolerance.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "support")]

import kvpress_c  # noqa: E402
from random_llama import write_random_llama  # noqa: E402

SHAPES = {"hd64": dict(layers=3, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=512),
          "hd128": dict(layers=2, hidden=1024, heads=8, kv_heads=2, ffn=1024, vocab=1000),
          "hd32-generic": dict(layers=2, hidden=128, heads=4, kv_heads=4, ffn=256, vocab=300)}


def rel(a, ref):
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(np.asarray(a, np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="emulated", choices=["emulated", "cuda"])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "device_tolerance.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in SHAPES.items():
            for seed in range(args.seeds):
                path = write_random_llama(os.path.join(tmp, f"{name}-{seed}"), seed=seed, **shape)
                cpu = kvpress_c.load_model(path)
                dev = kvpress_c.load_model(path, device=args.device)
                ids = np.random.default_rng(1000 + seed).integers(3, shape["vocab"], size=333).astype(np.int32)
                prefill = rel(dev.logits(ids), cpu.logits(ids))
                sc, sd = cpu.new_session(), dev.new_session()
                sc.forward(ids[:300], logits="none")
                sd.forward(ids[:300], logits="none")
                decode = max(rel(sd.forward(ids[i:i + 1], logits="last"), sc.forward(ids[i:i + 1], logits="last"))
                             for i in range(300, 310))
                rows.append({"shape": name, "seed": seed, "prefill": prefill, "decode": decode})
                print(f"{name:13s} seed {seed:2d}: prefill {prefill:.4f}  decode {decode:.4f}", flush=True)
                del cpu, dev
    summary = {k: max(r[k] for r in rows) for k in ("prefill", "decode")}
    per_shape = {n: {k: max(r[k] for r in rows if r["shape"] == n) for k in ("prefill", "decode")} for n in SHAPES}
    print("max over seeds:", json.dumps(per_shape), "overall:", json.dumps(summary))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": args.device, "device_name": kvpress_c.device_info(args.device)["device"],
                   "seeds": args.seeds, "max": summary, "per_shape": per_shape, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
