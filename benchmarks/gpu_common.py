"""Shared pieces of the GPU benchmarks (gpu_prefill.py, gpu_decode.py): the GPU check, the
Llama-3.1-8B-shaped random bf16 model (tests/support/random_llama.py writes it), the presses on both systems,
the measured GEMM / copy rates and FLOP counts, and the JSON + markdown output with the ratios the
targets are stated in (against the full cache, against the peer)."""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "support")]
from random_llama import LLAMA31_8B as LLAMA8B, llama31_8b_dir, write_llama31_bf16  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def require_gpu() -> None:
    """Exit with the reason when the CUDA backend cannot run here."""
    import kvpress_c
    if kvpress_c.cuda_available():
        return
    try:
        kvpress_c.device_info("cuda")
        reason = "unknown reason"
    except Exception as e:  # the loader's own message
        reason = str(e)
    sys.exit(f"{os.path.basename(sys.argv[0])}: this benchmark needs the CUDA backend and a GPU: {reason}")


# ---- presses: kvpress_c and kvpress side by side ----

def kvc_press(name: str, ratio: float, take_budget: int = 2048):
    import kvpress_c as K
    return {"full": None,
            "snapkv": K.SnapKVPress(compression_ratio=ratio),
            "adakv": K.AdaKVPress(K.SnapKVPress(compression_ratio=ratio)),
            "chunkkv": K.ChunkKVPress(K.SnapKVPress(compression_ratio=ratio), chunk_length=10),
            "take": K.TAKEPress(budget=take_budget),
            "edie_tada": K.TADAPress(K.EDIEPress(compression_ratio=ratio))}[name]


def hf_press(name: str, ratio: float):
    import kvpress as P
    return {"full": None,
            "snapkv": P.SnapKVPress(compression_ratio=ratio),
            "adakv": P.AdaKVPress(P.SnapKVPress(compression_ratio=ratio)),
            "chunkkv": P.ChunkKVPress(P.SnapKVPress(compression_ratio=ratio), chunk_length=10),
            "take": None, "edie_tada": None}[name]


def kvc_prefill(model, press, ids):
    """One compressed prefill on a fresh session; returns (seconds, session)."""
    s = model.new_session()
    if press is not None and press.attach_to_session and not press.is_noop:
        s.set_press(**press.c_config())
    t0 = time.perf_counter()
    if press is None:
        s.forward(ids, logits="last")
    else:
        press.prefill(s, ids, model.config)
    return time.perf_counter() - t0, s


def hf_prefill(hf, press, ids_t):
    """kvpress 0.5.x on HF transformers: the press as a context manager around the prefill.
    cache_position is passed explicitly: kvpress's hook reads it and transformers >= 5.3 no longer
    hands it to the attention layers. Returns (seconds, cache)."""
    import contextlib
    import torch
    from transformers import DynamicCache
    cache = DynamicCache()
    n = ids_t.shape[1]
    ctx = press(hf) if press is not None else contextlib.nullcontext()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad(), ctx:
        try:
            hf(ids_t, past_key_values=cache, use_cache=True, cache_position=torch.arange(n, device=ids_t.device),
               logits_to_keep=1)
        except TypeError:  # a transformers without the cache_position argument
            cache = DynamicCache()
            hf(ids_t, past_key_values=cache, use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, cache


def load_hf(path: str):
    import torch
    import transformers
    attn = "sdpa"
    try:
        import flash_attn  # noqa: F401
        attn = "flash_attention_2"
    except ImportError:
        pass
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=attn)
    return hf.cuda().eval(), attn


# ---- the command line and the two systems ----

def add_system_args(ap) -> None:
    """The last two options of both benchmarks: --systems and --model-dir."""
    ap.add_argument("--systems", nargs="+", default=["kvpress_c", "hf"])
    ap.add_argument("--model-dir", default=llama31_8b_dir())


def start(ap, argv):
    """Parses the command line, exits with the reason without a usable GPU, writes the model when it
    is not there yet: (args, model path)."""
    args = ap.parse_args(argv)
    require_gpu()
    return args, write_llama31_bf16(args.model_dir)


def run_systems(args, path, meta: dict, run_kvpress_c, run_hf) -> list[dict]:
    """The rows of the systems in args.systems, kvpress_c first; each run_*(args, path, rows) appends
    its rows. meta gets the device and its GEMM (kvpress_c), the attention implementation (HF), or why
    HF was skipped (an import failed)."""
    rows: list[dict] = []
    if "kvpress_c" in args.systems:
        info = run_kvpress_c(args, path, rows)
        meta.update(device=info["device"], kvpress_c_gemm=info["gemm"])
    if "hf" in args.systems:
        try:
            meta["hf_attention"] = run_hf(args, path, rows)
        except ImportError as e:
            meta["hf_skipped"] = f"{e} (install torch with CUDA, transformers and kvpress 0.5.x)"
    return rows


# ---- the measuring loops' shared steps ----

KVC_ERRORS = (NotImplementedError, RuntimeError, MemoryError, ValueError)  # what a kvpress_c point may raise


def random_ids(n: int) -> np.ndarray:
    """n prompt token ids (int64), seeded by n, clear of the special tokens at both ends of the vocabulary."""
    return np.random.default_rng(n).integers(1000, LLAMA8B["vocab"] - 1000, size=n)


def load_kvc(path: str):
    """Starts kvpress_c's CUDA backend and loads the model on it: (the kvpress_c module, device_info('cuda'),
    model). A missing cuBLAS (the built-in GEMM runs, several times slower) is printed loudly."""
    import kvpress_c
    info = kvpress_c.device_info("cuda")
    if info.get("warning"):
        print(f"WARNING: {info['warning']} (GEMM in use: {info['gemm']})", file=sys.stderr, flush=True)
    return kvpress_c, info, kvpress_c.load_model(path, device="cuda")


def load_hf_system(path: str):
    """torch, kvpress and transformers imported (ImportError when one is missing), the HF model loaded:
    (model, attention implementation, the system's name for the rows)."""
    import torch  # noqa: F401
    import kvpress
    import transformers
    hf, attn = load_hf(path)
    return hf, attn, f"kvpress {kvpress.__version__} / transformers {transformers.__version__} ({attn})"


def skip_missing_hf_press(name: str, press, row: dict, rows: list[dict]) -> bool:
    """True, with the row noted and kept, when kvpress has no press for `name` (other than "full")."""
    if name != "full" and press is None:
        row["error"] = "kvpress has no such press"
        rows.append(row)
        return True
    return False


def note_error(row: dict, e: BaseException) -> None:
    """A point that failed: its row keeps the exception instead of numbers."""
    row["error"] = f"{type(e).__name__}: {e}"


def emit(rows: list[dict], row: dict) -> None:
    """Keeps a finished row and shows it on stderr at once."""
    rows.append(row)
    print(row, file=sys.stderr, flush=True)


def free_cuda_memory() -> None:
    """After `del` of a model: collect it and give torch's cached GPU memory back."""
    import gc
    import torch
    gc.collect()
    torch.cuda.empty_cache()


# ---- rates and FLOPs ----

def gemm_rate_tflops(m: int = 8192, n: int = 14336, k: int = 4096, reps: int = 10) -> float | None:
    """cuBLAS bf16 GEMM rate through torch (None without torch CUDA)."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b.T
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b.T
    torch.cuda.synchronize()
    rate = 2 * m * n * k * reps / (time.perf_counter() - t0) / 1e12
    del a, b
    torch.cuda.empty_cache()  # give the memory back: kvpress_c allocates outside torch's cache
    return rate


def copy_rate_tbs(nbytes: int = 2 << 30, reps: int = 10) -> float | None:
    """Device-to-device copy rate (read + write bytes per second) through torch."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    rate = 2 * nbytes * reps / (time.perf_counter() - t0) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return rate


def sdpa_rate_tflops(n: int = 32768, H: int = 32, Hkv: int = 8, d: int = 128) -> float | None:
    """torch scaled_dot_product_attention, causal GQA: the bar for the attention kernel."""
    try:
        import torch
        import torch.nn.functional as Fn
        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    q = torch.randn(1, H, n, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, Hkv, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    Fn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    Fn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.cuda.synchronize()
    return attention_flops(n, H, d) / (time.perf_counter() - t0) / 1e12


def kvc_bench_seconds(what: int, dims) -> float | None:
    """kvpress_c's own kernels timed on the device (kvc_device_bench): 0 GEMM (m, n, k), 1 prefill
    attention (n, H, Hkv, d)."""
    import ctypes
    from kvpress_c import core_library_path
    lib = ctypes.CDLL(core_library_path())
    arr = (ctypes.c_int64 * len(dims))(*dims)
    out = ctypes.c_double()
    if lib.kvc_device_bench(ctypes.c_int32(1), ctypes.c_int32(what), arr, ctypes.c_int32(5), ctypes.byref(out)) != 0:
        return None
    return out.value


def kvc_gemm_tflops(m: int = 8192, n: int = 14336, k: int = 4096) -> float | None:
    t = kvc_bench_seconds(0, [m, n, k])
    return 2 * m * n * k / t / 1e12 if t else None


ATTENTION_KERNELS = {"wmma": 0, "mma": 1, "cudnn": 2}  # the CUDA backend's attention_kernel setting


def env_attention_kernel() -> str:
    """The prefill attention the model runs: KVC_ATTN_KERNEL=wmma|mma|cudnn (KVC_ATTN_MMA=1 is mma)."""
    k = os.environ.get("KVC_ATTN_KERNEL") or ("mma" if os.environ.get("KVC_ATTN_MMA") == "1" else "wmma")
    if k not in ATTENTION_KERNELS:
        raise SystemExit(f"KVC_ATTN_KERNEL={k}: one of {sorted(ATTENTION_KERNELS)}")
    return k


def use_attention_kernel(name: str) -> str | None:
    """Select a prefill attention kernel on CUDA; None, or the reason it cannot run (cuDNN absent)."""
    import ctypes
    from kvpress_c import core_library_path
    lib = ctypes.CDLL(core_library_path())
    lib.kvc_last_error.restype = ctypes.c_char_p
    if lib.kvc_device_set_option(ctypes.c_int32(1), b"attention_kernel", ctypes.c_int32(ATTENTION_KERNELS[name])) != 0:
        return (lib.kvc_last_error() or b"").decode()
    return None


def kvc_attention_tflops(n: int = 32768, H: int = 32, Hkv: int = 8, d: int = 128, kernel: str | None = None) -> float | None:
    """kernel: 'wmma', 'mma' (register tiles), 'cudnn' (cuDNN's SDPA), None the one in use. None when it cannot
    run here (the reason is printed)."""
    why = use_attention_kernel(kernel) if kernel is not None else None
    try:
        t = None if why else kvc_bench_seconds(1, [n, H, Hkv, d])
    finally:
        if kernel is not None:  # back to what the environment chose
            use_attention_kernel(env_attention_kernel())
    if why:
        print(f"attention kernel {kernel}: {why}", file=sys.stderr)
    return attention_flops(n, H, d) / t / 1e12 if t else None


def attention_flops(n: int, H: int, d: int) -> float:
    """Causal attention: Q K^T and P V over the lower triangle, 2 FLOPs per multiply-add."""
    return 2 * 2 * (n * (n + 1) / 2) * d * H


def prefill_flops(n: int, s: dict = LLAMA8B) -> float:
    D, F, hd = s["hidden"], s["ffn"], s["head_dim"]
    qd, kd = s["heads"] * hd, s["kv_heads"] * hd
    per_layer = 2 * n * D * (qd + 2 * kd) + 2 * n * qd * D + 2 * n * D * 2 * F + 2 * n * F * D
    return s["layers"] * (per_layer + attention_flops(n, s["heads"], hd)) + 2 * D * s["vocab"]


def weight_bytes(s: dict = LLAMA8B) -> int:
    D, F, hd = s["hidden"], s["ffn"], s["head_dim"]
    qd, kd = s["heads"] * hd, s["kv_heads"] * hd
    return 2 * (s["layers"] * (D * (qd + 2 * kd) + qd * D + 3 * D * F) + 2 * s["vocab"] * D)


def kv_bytes(tokens_per_head: float, s: dict = LLAMA8B) -> float:
    return s["layers"] * s["kv_heads"] * tokens_per_head * s["head_dim"] * 2 * 2


# ---- output ----

def kvc_system_name() -> str:
    """kvpress_c's rows are named after the opt-in switches of the run, so runs with and without them
    sit side by side in one table (KVC_DECODE_GRAPHS=1: decode steps as CUDA graphs; KVC_ATTN_MMA=1:
    the register-tile mma prefill attention; KVC_ATTN_KERNEL=cudnn: cuDNN's)."""
    name = "kvpress_c"
    if os.environ.get("KVC_DECODE_GRAPHS") == "1":
        name += " +graphs"
    if env_attention_kernel() != "wmma":
        name += " +" + env_attention_kernel()
    return name


def add_ratios(rows: list[dict], value: str, length: str) -> None:
    """The ratios the targets are stated in, for every row with `value` (seconds or ms, lower is better):
    vs_full = value / the same system's full-cache value at the same length (a press's overhead, or
    TAKE's speed-up when < 1); and on kvpress_c's rows, peer_x = the kvpress row's value / ours for
    the same length and press (> 1: kvpress_c is faster)."""
    def at(system_ok, n, press):
        for r in rows:
            if system_ok(str(r.get("system"))) and r.get(length) == n and r.get("press") == press and r.get(value):
                return r[value]
        return None

    for r in rows:
        v = r.get(value)
        if not v:
            continue
        full = at(lambda sys_: sys_ == r["system"], r.get(length), "full")
        r["vs_full"] = v / full if full else None
        if str(r["system"]).startswith("kvpress_c"):
            peer = at(lambda sys_: sys_.startswith("kvpress "), r.get(length), r.get("press"))
            r["peer_x"] = peer / v if peer else None


def write_results(name: str, meta: dict, rows: list[dict], columns: list[tuple[str, str]], title: str,
                  ratios: tuple[str, str] | None = None) -> None:
    """benchmarks/results/<name>.json and .md (a markdown table of `columns`: (key, header)). Rows of
    earlier runs are merged in; `ratios` = (value key, length key) adds vs_full and peer_x (add_ratios)
    over the merged rows."""
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name + ".json")
    # merge with earlier runs (one length per run fits the device's time limit): same point -> replaced
    key = lambda r: (r.get("system"), r.get("tokens", r.get("context")), r.get("press"))
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        new_keys = {key(r) for r in rows}
        rows = [r for r in old.get("rows", []) if key(r) not in new_keys] + rows
        meta = {**old.get("meta", {}), **{k: v for k, v in meta.items() if v is not None}}
    rows = sorted(rows, key=lambda r: (str(r.get("system")), r.get("tokens", r.get("context")) or 0, str(r.get("press"))))
    if ratios:
        add_ratios(rows, *ratios)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)

    def fmt(v):
        if v is None:
            return "n/a"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = [f"# {title}", "", "\n".join(f"- {k}: {fmt(v)}" for k, v in meta.items()), "",
             "| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |")
    with open(os.path.join(RESULTS, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {os.path.join(RESULTS, name + '.json')} and .md")
