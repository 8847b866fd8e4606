"""Decode of the default model, kvpress_c native and fp32 weights against llama.cpp, interleaved in one
process: tokens per CPU-second (process time, less sensitive to other jobs on a shared machine than wall
time) and tokens per wall-second, `--decode` greedy steps after a 512-token prompt, `--threads` each.

    python benchmarks/decode_cpu_time.py [--threads 1] [--decode 64] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import kvpress_c
    from llama_cpp import Llama
    path, n, th = kvpress_c.default_model_path(), args.decode, args.threads
    kvpress_c._core.set_num_threads(th)
    ids = np.random.default_rng(0).integers(100, 49000, size=512 + n).astype(np.int32)
    native, fp32 = kvpress_c.load_model(path), kvpress_c.load_model(path, weights="fp32")
    llm = Llama(model_path=path, n_ctx=1024, n_threads=th, n_threads_batch=th, verbose=False)

    def run(prepare, step):
        prepare()
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(n):
            step(i)
        return n / (time.process_time() - c0), n / (time.perf_counter() - t0)

    print(f"{th} thread(s), {n} decode steps after 512 tokens; tokens per CPU-second (per wall-second)")
    for _ in range(args.repeat):
        row = []
        for m in (native, fp32):
            s = m.new_session(512 + n)
            row.append(run(lambda: s.forward(ids[:512], logits="last"),
                           lambda i: s.forward(ids[512 + i:513 + i], logits="last")))
        row.append(run(lambda: (llm.reset(), llm.eval([int(t) for t in ids[:512]])),
                       lambda i: llm.eval([int(ids[512 + i])])))
        print("native %.1f (%.1f)   fp32 %.1f (%.1f)   llama.cpp %.1f (%.1f)   load average %.1f"
              % (*row[0], *row[1], *row[2], os.getloadavg()[0]))


if __name__ == "__main__":
    main()
