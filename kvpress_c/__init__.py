"""kvpress_c: KV-cache eviction research on a native (C/CUDA) Llama-family engine.

    import kvpress_c
    model = kvpress_c.load_model()              # embedded SmolLM2-135M-Instruct (GGUF Q4_1)
    print(model.generate("What is the capital of France?", max_new_tokens=20))
"""
from . import _core
from ._paths import core_library_path, default_model_path, openblas_path
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


def set_num_threads(n: int) -> None:
    """Threads used by the CPU backend (<= 0: all cores)."""
    _core.set_num_threads(int(n))


def cuda_available() -> bool:
    """True when the CUDA backend was built and a GPU is visible."""
    return bool(getattr(_core, "cuda_available", lambda: False)())


__all__ = ["Model", "load_model", "Pipeline", "PipelineResult", "BasePress", "ScorerPress", "SnapKVPress",
           "PyramidKVPress", "StreamingLLMPress", "KnormPress", "TOVAPress", "ObservedAttentionPress",
           "RandomPress", "AdaKVPress", "ChunkKVPress", "EDIEPress", "TADAPress", "TAKEPress", "JudgeQPress", "ResponseGuidedPress", "default_model_path", "core_library_path", "set_num_threads",
           "cuda_available", "__version__"]
