"""Host memory of loading a model onto a device: tensors are streamed from the file to the device a bounded
chunk at a time, so the host holds no copy of the weights (docs/ARCHITECTURE.md, "Loading onto a device").

For each model: a fresh process loads it on the device and reports its peak and final resident memory
beyond what it held before the load (tests/support/load_probe.py; the emulated device's buffers are
subtracted, so the figure is what a GPU load would cost the host). Also the CPU load of the same file
for comparison (fp32 weights: 4 bytes per parameter).

    python benchmarks/device_load_memory.py [--model 8b|small|PATH] [--device emulated|cuda] [--out FILE]

The 8B model is the Llama-3.1-8B-shaped random bf16 folder the GPU tests use (16 GB, written once to
random_llama.llama31_8b_dir()); its CPU load (32 GB of fp32) is skipped where it would not fit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "support")]

from load_probe import measure  # noqa: E402
from random_llama import llama31_8b_dir, write_llama31_bf16  # noqa: E402

SMALL = dict(layers=4, hidden=1024, heads=8, kv_heads=2, head_dim=128, ffn=4096, vocab=32000)

def total_memory() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="8b", help="8b, small, or a model path")
    ap.add_argument("--device", default="emulated", choices=["emulated", "cuda"])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "device_load_memory.json"))
    args = ap.parse_args()
    if args.model == "8b":
        t0 = time.perf_counter()
        path = write_llama31_bf16(llama31_8b_dir())
        print(f"8B-shaped model at {path} ({time.perf_counter() - t0:.0f} s to write or find)", flush=True)
    elif args.model == "small":
        path = write_llama31_bf16(os.path.join(ROOT, "runs", "llama31_small_bf16"), SMALL)
    else:
        path = args.model
    file_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")) \
        if os.path.isdir(path) else os.path.getsize(path)
    rows = [measure(path, args.device)]
    if file_bytes * 2 + 2e9 < total_memory():  # fp32 on the CPU is twice the bf16 file
        rows.append(measure(path, "cpu"))
    else:
        rows.append({"device": "cpu", "skipped": f"fp32 weights ({2 * file_bytes / 1e9:.1f} GB) exceed this machine's memory"})
    for r in rows:
        if "host_peak_beyond_device" in r:
            print(f"{r['device']:9s} load {r['seconds']:6.1f} s: host peak beyond the device's buffers "
                  f"{r['host_peak_beyond_device'] / 1e6:8.1f} MB, after {r['host_after_beyond_device'] / 1e6:8.1f} MB "
                  f"(weights {r['weight_bytes'] / 1e9:.2f} GB on the device)")
        else:
            print(r)
    result = {"model": args.model, "path": path, "file_bytes": file_bytes, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
