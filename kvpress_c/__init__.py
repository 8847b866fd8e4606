"""kvpress_c: KV-cache eviction research on a native (C/CUDA) Llama-family engine.

    import kvpress_c
    model = kvpress_c.load_model()              # embedded SmolLM2-135M-Instruct (GGUF Q4_1)
    print(model.generate("What is the capital of France?", max_new_tokens=20))
"""
from . import _core
from ._paths import core_library_path, cublas_path, default_model_path, openblas_path
from .model import Model, load_model
from .pipeline import Pipeline, PipelineResult
from .saved import cache_info, load_session, save_session
from .conversation import Conversation
from .kv_cache import QuantizedCache
from . import presses as _presses
from .presses import *  # noqa: F401,F403  (every press of kvpress_c/presses/, discovered there)
from .presses.from_kvpress import from_kvpress  # kvpress's own ScorerPresses inside the engine

__version__ = _core.__version__


def _init_blas():
    # Prefer OpenBLAS from the scipy-openblas32 wheel for large GEMMs (see README, "GEMM").
    import os
    if os.environ.get("KVPRESS_C_BLAS", "1") == "0":
        return
    path = openblas_path()
    if path:
        try:
            _core.set_blas(path, "scipy_cblas_sgemm")
        except (OSError, ValueError, RuntimeError):
            pass


_init_blas()


def _init_cublas():
    # the CUDA backend (if used) opens cuBLAS from KVC_CUBLAS first: point it at a pip-installed copy
    import os
    if "KVC_CUBLAS" not in os.environ:
        path = cublas_path()
        if path:
            os.environ["KVC_CUBLAS"] = path


_init_cublas()


def set_num_threads(n: int) -> None:
    """Threads used by the CPU backend (<= 0: all cores)."""
    _core.set_num_threads(int(n))


DEVICES = ("cpu", "cuda", "emulated")


def device_available(device: str = "cuda") -> bool:
    """True when `device` can run: 'cpu' and 'emulated' always; 'cuda' when the CUDA backend was built and
    a usable GPU is visible."""
    return bool(_core.device_available(device))


def cuda_available() -> bool:
    """True when the CUDA backend was built and a GPU is visible."""
    return device_available("cuda")


def device_info(device: str = "cuda") -> dict:
    """{'device': name, 'gemm': the GEMM in use} of a device; RuntimeError with the reason when it cannot
    run here. On CUDA, 'gemm' names cuBLAS, or the built-in fallback (much slower) when cuBLAS was not
    found, and 'warning' then says so."""
    info = _core.device_info(device)
    if device == "cuda" and not info["gemm"].startswith("cublas"):
        info["warning"] = ("cuBLAS was not found: the built-in GEMM runs, several times slower; install "
                           "nvidia-cublas or point KVC_CUBLAS at libcublas.so")
    return info


def cuda_info() -> dict:
    """device_info('cuda')."""
    return device_info("cuda")


def memory_stats(device: str = "cuda", reset_peak: bool = False) -> dict:
    """Bytes held by a device's backend: current, peak (since the last reset), weights, cache, cache_peak,
    activations, activations_peak, device_total. reset_peak=True starts the peaks again after reading."""
    stats = _core.memory_stats(device)
    if reset_peak:
        _core.reset_peak(device)
    return stats


def device_traffic(device: str = "cuda", reset: bool = False) -> dict:
    """Host-device traffic of a device's backend since the last reset: downloads, uploads, syncs (waits of the
    host for the device), down_bytes, up_bytes. reset=True starts the counters again after reading. The
    emulated device counts what the CUDA backend would move; NotImplementedError on the CPU."""
    return _core.device_traffic(device, reset)


def cuda_memory_stats(reset_peak: bool = False) -> dict:
    """memory_stats('cuda')."""
    return memory_stats("cuda", reset_peak)


# Subpackages imported on first use, so `kvpress_c.eval.run(...)` works after a plain `import kvpress_c`
# while the import itself stays light (the harness and its metrics load only when asked for).
_LAZY = ("eval", "judgeq")


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Model", "load_model", "Pipeline", "PipelineResult", "Conversation", "QuantizedCache", "load_session", "save_session", "cache_info", *_presses.__all__, "from_kvpress", "default_model_path",
           "core_library_path", "set_num_threads", "DEVICES", "device_available", "device_info", "memory_stats",
           "device_traffic",
           "cuda_available", "cuda_info", "cuda_memory_stats", "__version__"]
