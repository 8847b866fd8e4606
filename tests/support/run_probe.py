"""Memory and speed of one engine on one GGUF file, measured in a fresh process (nothing loaded before
counts): resident memory after the load (VmRSS, and its anonymous and file-page parts RssAnon, RssFile)
and its peak (VmHWM), beyond what the process held before, load seconds, prefill tok/s of n random tokens, decode tok/s of greedy steps after it, and for
kvpress_c a press (SnapKV, ratio 0.5) on the same prompt. Speeds are also given per second of the process's CPU
time (`*_per_cpu_s`): on a shared machine, what a run on one thread costs whatever else is scheduled. Used by tests/model/test_llama8b_native.py
and benchmarks/cpu_forward.py.

    python run_probe.py ENGINE MODEL_PATH PREFILL DECODE [THREADS]   # one JSON line

ENGINE: kvpress_c, llama.cpp, or llama.cpp-no-repack (llama.cpp without its extra CPU buffer types, the repacked and
AMX layouts: what `--no-repack` does in llama.cpp's tools).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _probe(engine: str, path: str, n_prefill: int, n_decode: int, threads: int) -> dict:
    if engine == "kvpress_c":
        import kvpress_c  # imported before the baseline: the library is not the model
        kvpress_c._core.set_num_threads(threads)
    else:
        from llama_cpp import Llama
        if engine == "llama.cpp-no-repack":
            import llama_cpp.llama as llama_py
            default = llama_py.llama_cpp.llama_model_default_params

            def no_extra_bufts():
                p = default()
                p.use_extra_bufts = False
                return p
            llama_py.llama_cpp.llama_model_default_params = no_extra_bufts
    before = _status("VmRSS")
    before_anon, before_file = _status("RssAnon"), _status("RssFile")
    t0 = time.perf_counter()
    if engine == "kvpress_c":
        model = kvpress_c.load_model(path)
        vocab = model.config["vocab"]
    else:
        llm = Llama(model_path=path, n_ctx=n_prefill + n_decode + 16, n_batch=min(n_prefill, 2048),
                    n_ubatch=min(n_prefill, 512), n_threads=threads, n_threads_batch=threads, verbose=False)
        vocab = llm.n_vocab()
    out = {"engine": engine, "threads": threads, "load_s": time.perf_counter() - t0,
           "rss_after_load": _status("VmRSS") - before,
           # anonymous memory vs file pages (kvpress_c's weights used in place in the mapped file, llama.cpp's mmap)
           "rss_anon_after_load": _status("RssAnon") - before_anon, "rss_file_after_load": _status("RssFile") - before_file}
    ids = np.random.default_rng(0).integers(300, vocab - 100, n_prefill + n_decode).astype(np.int32)
    steps, cpu_steps = [], []
    if engine == "kvpress_c":
        s = model.new_session(n_prefill + n_decode)
        t0, c0 = time.perf_counter(), time.process_time()
        logits = s.forward(ids[:n_prefill], logits="last")
        out["prefill_s"], out["prefill_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        for i in range(n_decode):
            t0, c0 = time.perf_counter(), time.process_time()
            logits = s.forward(ids[n_prefill + i:n_prefill + i + 1], logits="last")
            steps.append(time.perf_counter() - t0)
            cpu_steps.append(time.process_time() - c0)
        out["finite"] = bool(np.all(np.isfinite(logits)))
        out["memory"] = model.memory()
        out["cache_bytes"] = s.cache_bytes
        from kvpress_c import SnapKVPress
        p = model.new_session(n_prefill)
        p.set_press(**SnapKVPress(compression_ratio=0.5).c_config())
        t0 = time.perf_counter()
        p.forward(ids[:n_prefill], logits="last")
        out["press_prefill_s"] = time.perf_counter() - t0
        lens = np.asarray(p.cache_lengths())
        out["press_cache_fraction"] = float(lens.sum() / (lens.size * n_prefill))
    else:
        t0, c0 = time.perf_counter(), time.process_time()
        llm.eval([int(t) for t in ids[:n_prefill]])
        out["prefill_s"], out["prefill_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        for i in range(n_decode):
            t0, c0 = time.perf_counter(), time.process_time()
            llm.eval([int(ids[n_prefill + i])])
            steps.append(time.perf_counter() - t0)
            cpu_steps.append(time.process_time() - c0)
    out["prefill_tok_s"] = n_prefill / out["prefill_s"]
    out["prefill_tok_per_cpu_s"] = n_prefill / out["prefill_cpu_s"]
    if steps:
        out["decode_tok_s_median"] = 1 / float(np.median(steps))
        out["decode_tok_s_best"] = 1 / float(np.min(steps))
        out["decode_tok_per_cpu_s_median"] = 1 / float(np.median(cpu_steps))
    out["rss_peak"] = _status("VmHWM") - before
    return out


def measure(engine: str, path: str, n_prefill: int, n_decode: int, threads: int | None = None) -> dict:
    """The probe's figures from a fresh process, or {"engine", "error"} with its last line of stderr."""
    threads = threads or os.cpu_count()
    out = subprocess.run([sys.executable, os.path.abspath(__file__), engine, path, str(n_prefill), str(n_decode),
                          str(threads)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    if out.returncode != 0:
        why = "killed by signal %d" % -out.returncode if out.returncode < 0 else "exit status %d" % out.returncode
        return {"engine": engine, "error": f"{why}: {(out.stderr.strip().splitlines() or ['no message'])[-1]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    e, p, n, d = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(_probe(e, p, n, d, int(sys.argv[5]) if len(sys.argv) > 5 else os.cpu_count())))
