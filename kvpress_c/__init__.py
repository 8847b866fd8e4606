"""kvpress_c: KV-cache eviction research on a native (C/CUDA) Llama-family engine.

    import kvpress_c
    model = kvpress_c.load_model()              # embedded SmolLM2-135M-Instruct (GGUF Q4_1)
    print(model.generate("What is the capital of France?", max_new_tokens=20))
"""
from . import _core
from ._paths import core_library_path, cublas_path, default_model_path, openblas_path
from .model import Model, load_model
from .pipeline import Pipeline, PipelineResult
from .presses import (AdaKVPress, BasePress, ChunkKVPress, EDIEPress, TADAPress, TAKEPress, JudgeQPress, ResponseGuidedPress, KnormPress, ObservedAttentionPress, PyramidKVPress, RandomPress,
                      ScorerPress, SnapKVPress, StreamingLLMPress, TOVAPress)

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


def cuda_available() -> bool:
    """True when the CUDA backend was built and a GPU is visible."""
    return bool(getattr(_core, "cuda_available", lambda: False)())


def cuda_info() -> dict:
    """{'device': name, 'gemm': GEMM in use} of the CUDA backend; RuntimeError with the reason when
    it cannot run here."""
    return _core.cuda_init()


def cuda_memory_stats(reset_peak: bool = False) -> dict:
    """Device bytes held by the CUDA backend: current, peak (since the last reset), weights, cache,
    cache_peak, activations, activations_peak, device_total. reset_peak=True starts the peaks again
    after reading them."""
    stats = _core.cuda_memory_stats()
    if reset_peak:
        _core.cuda_reset_peak()
    return stats


__all__ = ["Model", "load_model", "Pipeline", "PipelineResult", "BasePress", "ScorerPress", "SnapKVPress",
           "PyramidKVPress", "StreamingLLMPress", "KnormPress", "TOVAPress", "ObservedAttentionPress",
           "RandomPress", "AdaKVPress", "ChunkKVPress", "EDIEPress", "TADAPress", "TAKEPress", "JudgeQPress", "ResponseGuidedPress", "default_model_path", "core_library_path", "set_num_threads",
           "cuda_available", "cuda_info", "cuda_memory_stats", "__version__"]
