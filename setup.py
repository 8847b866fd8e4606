"""Build of kvpress_c.

Two native products:
  kvpress_c/libkvpress_c.so  the C core (csrc/), public ABI in csrc/include/kvpress_c.h, no Python
  kvpress_c/_core.*.so       the CPython module (python/_core.c), linked to the core with rpath $ORIGIN

Environment:
  KVC_NATIVE=0      do not pass -march=native (portable build)
  KVC_DEBUG=1       -O0 -g, no -march=native
  KVC_SANITIZE=1    AddressSanitizer + UBSan (run python with LD_PRELOAD=$(gcc -print-file-name=libasan.so))
  KVC_CUDA=0        never build the CUDA backend even if nvcc is found
  KVC_CUDA_ARCH=90  compute capabilities for nvcc, e.g. 90, 90a or 80,90 (default sm_90)
  KVC_CUDNN=0       do not build the cuDNN attention library (libkvpress_c_cudnn.so)
  KVC_CUDNN_FETCH=1 download the cuDNN headers when build/cudnn/ lacks them (the PyPI packages
                    nvidia-cudnn-cu13, several hundred MB, and nvidia-cudnn-frontend, unpacked into that build
                    cache; `python setup.py fetch_cudnn` does only that). Off by default: without them the
                    cuDNN attention is not built and the CUDA backend runs its own kernels
"""
import glob
import os
import shutil
import subprocess
import sys
import zipfile

import numpy
from setuptools import Command, Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def c_sources():
    files = sorted(glob.glob(os.path.join("csrc", "**", "*.c"), recursive=True))
    return [f for f in files if os.sep + "cuda" + os.sep not in f]


def cuda_sources():
    return sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))


def c_flags():
    debug = os.environ.get("KVC_DEBUG") == "1"
    flags = ["-std=c11", "-fPIC", "-fopenmp", "-fvisibility=hidden", "-D_GNU_SOURCE", "-Wall",
             "-Wextra", "-Wno-unused-parameter", "-Wno-sign-compare"]
    if os.environ.get("KVC_SANITIZE") == "1":
        flags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
    if debug:
        flags += ["-O0", "-g"]
    else:
        flags += ["-O3", "-ffp-contract=fast", "-fno-math-errno"]
        if os.environ.get("KVC_NATIVE", "1") != "0":
            flags += ["-march=native"]
    return flags


def find_nvcc():
    if os.environ.get("KVC_CUDA", "1") == "0":
        return None
    nvcc = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
    return nvcc or None


def find_cuda_libdir(nvcc):
    # Only the CUDA runtime is linked (statically: the library then needs nothing but the driver at
    # run time); cuBLAS is opened with dlopen when present (backend/cuda/gemm.cu), so it is not needed
    # to build. nvcc may be a wrapper script: also look next to the CUDA installs.
    home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    for cand in (os.environ.get("CUDA_HOME"), home, "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"))):
        for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
            d = cand and os.path.join(cand, sub)
            if d and os.path.exists(os.path.join(d, "libcudart_static.a")):
                return d
    return None


def cuda_headers():
    return sorted(glob.glob(os.path.join("csrc", "backend", "cuda", "*.cuh")) +
                  glob.glob(os.path.join("csrc", "backend", "cuda", "*.h")) +
                  [os.path.join("csrc", "include", "kvpress_c.h"), os.path.join("csrc", "core", "backend.h"),
                   os.path.join("csrc", "core", "common.h"), os.path.join("csrc", "core", "kv_layout.h"),
                   os.path.join("csrc", "core", "kv_type.h"), os.path.join("csrc", "core", "kv_undo.h"),
                   os.path.join("csrc", "core", "half.h")])


# cuDNN's attention is a build-time dependency only: the headers of the PyPI packages, unpacked into a build cache
# (never committed), and libcudnn.so.9's loader stub to link against; the library itself is opened at run time.
# The frontend is pinned: later versions include an NVRTC-based engine (nvrtc.h and libnvrtc at build and run time).
CUDNN_FRONTEND = "nvidia-cudnn-frontend==1.16.0"
CUDNN_PACKAGE = "nvidia-cudnn-cu13"
CUDNN_CACHE = os.path.join(ROOT, "build", "cudnn")


def cudnn_sources():
    return sorted(glob.glob(os.path.join("csrc", "backend", "cudnn", "*.cpp")))


def _unpack(wheel, prefix, dest, only=None):
    """the wheel's files under prefix (only: those of these names) into dest, paths relative to prefix"""
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith(prefix) and not name.endswith("/") and (only is None or os.path.basename(name) in only):
                out = os.path.join(dest, name[len(prefix):])
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with z.open(name) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)


def cudnn_build_inputs(fetch=None):
    """(cuDNN include dir, frontend include dir, dir of libcudnn.so.9) from the build cache, downloading and
    unpacking the two packages there once; None (with the reason printed) when they cannot be had."""
    inc, fe_inc, lib = (os.path.join(CUDNN_CACHE, p) for p in ("cudnn/include", "frontend/include", "cudnn/lib"))
    if all(os.path.exists(os.path.join(d, f)) for d, f in ((inc, "cudnn.h"), (fe_inc, "cudnn_frontend.h"),
                                                            (lib, "libcudnn.so.9"))):
        return inc, fe_inc, lib
    if not (fetch if fetch is not None else os.environ.get("KVC_CUDNN_FETCH", "0") == "1"):
        print("kvpress_c: no cuDNN headers in build/cudnn (KVC_CUDNN_FETCH=1 or `setup.py fetch_cudnn` downloads "
              "them): the cuDNN attention is not built", file=sys.stderr)
        return None
    wheels = os.path.join(CUDNN_CACHE, "wheels")
    try:
        subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                               wheels, CUDNN_PACKAGE, CUDNN_FRONTEND])
        for w in glob.glob(os.path.join(wheels, "nvidia_cudnn_cu13-*.whl")):
            _unpack(w, "nvidia/cudnn/include/", inc)
            _unpack(w, "nvidia/cudnn/lib/", lib, only=("libcudnn.so.9",))  # the loader stub, to link against
        for w in glob.glob(os.path.join(wheels, "nvidia_cudnn_frontend-*.whl")):
            _unpack(w, "include/", fe_inc)
    except (subprocess.CalledProcessError, OSError, zipfile.BadZipFile) as exc:
        print(f"kvpress_c: the cuDNN headers could not be had ({exc}): the cuDNN attention is not built", file=sys.stderr)
        return None
    return cudnn_build_inputs(False) if os.path.exists(os.path.join(lib, "libcudnn.so.9")) else None


def nvcc_link(nvcc, out_dir, name, objects, libs):
    """A shared library `name` in out_dir from nvcc objects, the CUDA runtime static; returns its path."""
    path = os.path.join(out_dir, name)
    cmd = [nvcc, "-shared", "--cudart=static", "-o", path, *objects, *libs, f"-Xlinker=-soname,{name}", "-ldl",
           "-lpthread", "-lrt"]
    print(" ".join(cmd))
    subprocess.check_call(cmd)
    return path


class FetchCudnn(Command):
    """setup.py fetch_cudnn: the cuDNN headers and loader stub into build/cudnn/ (a GPU session's prebuild)."""
    description = "download the cuDNN build inputs into build/cudnn"
    user_options = []

    def initialize_options(self):
        pass

    def finalize_options(self):
        pass

    def run(self):
        if cudnn_build_inputs(True) is None:
            raise SystemExit("kvpress_c: the cuDNN build inputs could not be had")


class BuildExt(build_ext):
    """Builds libkvpress_c.so first, then the extension linked against it."""

    def build_extensions(self):
        out_dir = os.path.dirname(self._lib_build_path())
        os.makedirs(out_dir, exist_ok=True)
        lib_path = self._build_core_library(out_dir)
        for ext in self.extensions:
            ext.library_dirs.append(os.path.dirname(lib_path))
            ext.libraries.append("kvpress_c")
            ext.runtime_library_dirs.append("$ORIGIN")
        super().build_extensions()

    def _lib_build_path(self):
        return os.path.join(self.build_lib, "kvpress_c", "libkvpress_c.so")

    def copy_extensions_to_source(self):
        # in-place builds (build_ext --inplace, editable installs) copy the extension and the core
        # library next to the sources; copy-then-rename, so a process that has the old files mapped
        # keeps them intact (an in-place overwrite would crash it with SIGBUS)
        build_py = self.get_finalized_command("build_py")
        package_dir = build_py.get_package_dir("kvpress_c")
        outputs = [self._lib_build_path()]
        for attr, name in (("_cuda_lib", "libkvpress_c_cuda.so"), ("_cudnn_lib", "libkvpress_c_cudnn.so")):
            if getattr(self, attr, None):
                outputs.append(getattr(self, attr))
            else:  # not built this time: no stale library from an earlier build may stay beside the core
                stale = os.path.join(package_dir, name)
                if os.path.exists(stale):
                    os.remove(stale)
        for ext in self.extensions:
            outputs.append(os.path.join(self.build_lib, self.get_ext_filename(self.get_ext_fullname(ext.name))))
        for src in outputs:
            dst = os.path.join(package_dir, os.path.basename(src))
            shutil.copyfile(src, dst + ".tmp")
            os.replace(dst + ".tmp", dst)

    def get_outputs(self):
        return super().get_outputs() + [self._lib_build_path()]

    def _build_core_library(self, out_dir):
        cc = self.compiler
        objects = cc.compile(c_sources(), output_dir=self.build_temp, include_dirs=["csrc/include"],
                             extra_postargs=c_flags())
        link_args = ["-fopenmp", "-ldl", "-lm"]
        if os.environ.get("KVC_SANITIZE") == "1":
            link_args += ["-fsanitize=address,undefined"]
        lib_path = os.path.join(out_dir, "libkvpress_c.so")
        cc.link_shared_object(objects, lib_path, extra_postargs=link_args + ["-Wl,-soname,libkvpress_c.so"])
        self._build_cuda_library(out_dir)
        return lib_path

    def _build_cuda_library(self, out_dir):
        # The CUDA backend is a separate library the core opens at run time (cuda_api.h), so the
        # core never depends on CUDA and a failed CUDA build leaves a working CPU-only install.
        nvcc = find_nvcc()
        if not cuda_sources():
            return
        if not nvcc:
            print("kvpress_c: nvcc not found (or KVC_CUDA=0): building the CPU backend only", file=sys.stderr)
            return
        lib_dir = find_cuda_libdir(nvcc)
        if lib_dir is None:
            print("kvpress_c: nvcc found but no libcudart_static.a next to it: building the CPU backend only",
                  file=sys.stderr)
            return
        try:
            objects = self._build_cuda(nvcc)
            path = nvcc_link(nvcc, out_dir, "libkvpress_c_cuda.so", objects, [f"-L{lib_dir}"])
            print(f"kvpress_c: built the CUDA backend ({path})", file=sys.stderr)
        except (subprocess.CalledProcessError, OSError) as exc:
            print(f"kvpress_c: the CUDA backend did not build ({exc}); building the CPU backend only. "
                  "Set KVC_CUDA=0 to skip the attempt.", file=sys.stderr)
            return
        self._cuda_lib = path
        self._build_cudnn_library(nvcc, out_dir, lib_dir)

    def _build_cudnn_library(self, nvcc, out_dir, lib_dir):
        # cuDNN's attention (csrc/backend/cudnn): a library of its own, linked to libcudnn.so.9, that the CUDA
        # backend opens at run time; its absence only means the backend's own attention kernels run
        self._cudnn_lib = None
        if os.environ.get("KVC_CUDNN") == "0" or not cudnn_sources():
            return
        arch = os.environ.get("KVC_CUDA_ARCH", "90")
        archs = [a.strip().replace("sm_", "").replace("compute_", "") for a in arch.replace(";", ",").split(",") if a.strip()]
        obj_dir = os.path.join(self.build_temp, "csrc", "backend", "cudnn")
        stub = os.path.join(self.build_temp, "cudnn_lib")  # libcudnn.so.9 to link against, kept beside the objects
        objects, fresh = [], True
        deps = max(os.path.getmtime(f) for f in glob.glob(os.path.join("csrc", "backend", "cudnn", "*")))
        for src in cudnn_sources():
            obj = os.path.join(obj_dir, os.path.basename(src) + ".o")
            objects.append(obj)
            fresh = fresh and os.path.exists(obj) and os.path.getmtime(obj) > deps
        try:
            if not (fresh and os.path.exists(os.path.join(stub, "libcudnn.so.9"))):
                inputs = cudnn_build_inputs()
                if inputs is None:
                    return
                inc, fe_inc, lib = inputs
                os.makedirs(obj_dir, exist_ok=True)
                os.makedirs(stub, exist_ok=True)
                shutil.copyfile(os.path.join(lib, "libcudnn.so.9"), os.path.join(stub, "libcudnn.so.9"))
                for src, obj in zip(cudnn_sources(), objects):
                    cmd = [nvcc, "-O2", "-std=c++17", "-x", "cu", "-Xcompiler", "-fPIC,-fvisibility=hidden",
                           *[f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs],
                           f"-I{fe_inc}", f"-I{inc}", "-c", src, "-o", obj]
                    print(" ".join(cmd))
                    subprocess.check_call(cmd)
            path = nvcc_link(nvcc, out_dir, "libkvpress_c_cudnn.so", objects,
                             [f"-L{lib_dir}", f"-L{stub}", "-l:libcudnn.so.9"])
            print(f"kvpress_c: built the cuDNN attention ({path})", file=sys.stderr)
        except (subprocess.CalledProcessError, OSError) as exc:
            print(f"kvpress_c: the cuDNN attention did not build ({exc}); the CUDA backend runs its own kernels. "
                  "Set KVC_CUDNN=0 to skip the attempt.", file=sys.stderr)
            return
        self._cudnn_lib = path

    def _build_cuda(self, nvcc):
        # "90", "sm_90", "90a" or several: "80,90"
        arch = os.environ.get("KVC_CUDA_ARCH", "90")
        archs = [a.strip().replace("sm_", "").replace("compute_", "") for a in arch.replace(";", ",").split(",") if a.strip()]
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        objects = []
        # an object newer than its source, every CUDA header and the arch stamp is reused (nvcc is slow)
        stamp = os.path.join(self.build_temp, "csrc", "cuda_arch.txt")
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        if not os.path.exists(stamp) or open(stamp).read() != arch:
            with open(stamp, "w") as f:
                f.write(arch)
        deps = max(os.path.getmtime(h) for h in cuda_headers() + [stamp] if os.path.exists(h))
        for src in cuda_sources():
            obj = os.path.join(self.build_temp, src + ".o")
            os.makedirs(os.path.dirname(obj), exist_ok=True)
            if os.path.exists(obj) and os.path.getmtime(obj) > max(deps, os.path.getmtime(src)):
                objects.append(obj)
                continue
            cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden",
                   *gencode, "-DKVC_WITH_CUDA=1",
                   "-Icsrc/include", "-c", src, "-o", obj]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            objects.append(obj)
        return objects


core = Extension(
    "kvpress_c._core",
    sources=sorted(glob.glob(os.path.join("python", "*.c")) + glob.glob(os.path.join("python", "presses", "*.c"))),
    include_dirs=["csrc/include", "python", numpy.get_include()],
    depends=["python/core.h", "csrc/include/kvpress_c.h"],
    extra_compile_args=["-std=c11", "-O2", "-fvisibility=hidden", "-Wall", "-Wno-unused-parameter"],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_22_API_VERSION")],
)

setup(ext_modules=[core], cmdclass={"build_ext": BuildExt, "fetch_cudnn": FetchCudnn})
