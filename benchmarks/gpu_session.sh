#!/usr/bin/env bash
# One GPU session that counts: two device calls inside the 15 minutes of device time a lent session has now (the
# device README: starts, idle waits and transfers count; no machine starts with under 4 minutes left; 10 min a
# call), each ending inside its own budget whatever happens (every step runs under `timeout`, capped by what is
# left of the call's budget and by what the steps after it reserve): together at most 690 s (11.5 min) of
# commands, plus ~1.5 min for the machine's start and ~0.5 for the transfers: ~13.5 of the 15 minutes. Call
# give_back right after (b), unless the third call below follows at once: a warm machine's idle 30 s count too.
#
# Before the session, HERE (this machine, in the checkout the device tool sends: the session's own one):
#   bash benchmarks/gpu_session.sh fetch-wheels   # kvpress 0.5.5 + transformers 5.2 (+ what they import that
#                                                 # the GPU image lacks) into .whl/ (ignored by git), once
#   bash benchmarks/gpu_session.sh prebuild       # the CUDA objects (nvcc 13, sm_90) into build/, so the
#                                                 # device only links (compiling there takes minutes of the 15);
#                                                 # ignored if csrc/ changed since; with the cuDNN attention's
#                                                 # object where build/cudnn holds the cuDNN headers (any local
#                                                 # `setup.py build_ext` with nvcc fills it: the device cannot
#                                                 # download them, so this is its only way there)
#
# The device calls, in this order, back to back (a machine stays warm 30 s after a call: the build in
# build/ and kvpress_c/*.so are then reused; each call also works on a bare machine, building again):
#   (a) run command: bash benchmarks/gpu_session.sh test
#       carry: C   timeout_s: 330   runs at most 300 s
#       build (parallel nvcc where the objects are not carried, log), every device test -k cuda (tests/device/*,
#       tests/press/test_think_freed.py; junit xml + log; at most 190 s, less what the build takes past ~5 s), the
#       CUDA kernel tests under compute-sanitizer memcheck and racecheck (a small subset, 30 s each), the
#       cuda-vs-cpu logits tolerance (10 seeds, 30 s)
#   (b) run command: bash benchmarks/gpu_session.sh bench
#       carry: C   timeout_s: 420   runs at most 390 s (its first step writes the 16 GB 8B-shaped model: ~1 min)
#       TTFT 8k/32k (full + seed presses), decode, against kvpress/HF in the same run; peak memory, attention
#       TFLOP/s per kernel, ratios to the FLOP and bandwidth floors; JSON naming the device, and the tables;
#       then the 8B-shaped tests (HF logits parity, TAKE at 128k) on the model the benchmarks wrote
# Where status says more than 5 minutes are left after (b) (its steps ended early), a third call on the warm
# machine within 30 s: KVC_SESSION_BUDGET=B bash benchmarks/gpu_session.sh bench128k, B what is left less 90 s,
# timeout_s B + 30 (TTFT at 128k: full, SnapKV and TAKE first, gpu_prefill_128k.json; then the other presses,
# gpu_prefill_128k_rest.json, which holds the first step's rows too); else it is the next lent session's.
# C, the carry list: [".whl", "build/temp.linux-x86_64-cpython-312"] after `prebuild`, else [".whl"]. Never
# name build/temp...-312 without having it here: a carried path missing here is removed there, the warm
# machine's objects with it. (docs/results/gpu/README.md says the same, and what to commit afterwards.)
#
# Other steps (not part of the two calls): test8b (the 8B-shaped tests alone), bench-opt (the opt-in switches),
# bench-kv (decode by K/V cache type, issue 27), bench128k (every press at 128k).
# KVC_SESSION_BUDGET=<seconds> overrides a step's budget. Logs and results go to $OUT (the device tool
# brings back at most 8 files: each call writes at most 8), else ./gpu_out.
set -uo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.." || exit 2
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
T0=$SECONDS
BUDGET=400
SUMMARY="$OUT/summary.txt"
FAILED=0

note() { echo "$*" | tee -a "$SUMMARY"; }

left() { echo $((BUDGET - (SECONDS - T0))); }

# upto CAP RESERVE: CAP seconds, or fewer so that RESERVE seconds stay for the steps after
upto() {
    local c=$(($(left) - 15 - $2))
    ((c > $1)) && c=$1
    echo "$c"
}

# step NAME CAP LOG CMD...: CMD under `timeout` for min(CAP, what is left of the budget less 15 s of margin),
# its output appended to $OUT/LOG and shown; one line in the summary. Skipped when under 20 s are left.
step() {
    local name=$1 cap=$2 log=$3
    shift 3
    local t
    t=$(($(left) - 15))
    ((t > cap)) && t=$cap
    if ((t < 20)); then
        note "$name: SKIPPED (no time left in the ${BUDGET} s budget)"
        FAILED=1
        return 124
    fi
    local s=$SECONDS
    echo "=== $name (limit $t s)" >>"$OUT/$log"
    timeout -k 5 "$t" "$@" 2>&1 | tee -a "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    local how=ok
    ((rc == 124 || rc == 137)) && how="TIMED OUT"
    ((rc != 0 && rc != 124 && rc != 137)) && how="FAILED"
    note "$name: $how (rc $rc, $((SECONDS - s)) s of $t s; log $log)"
    ((rc != 0)) && FAILED=1
    return "$rc"
}

finish() {
    note "total: $((SECONDS - T0)) s of the ${BUDGET} s budget; $([ "$FAILED" = 0 ] && echo 'every step passed' || echo 'some step FAILED')"
    exit "$FAILED"
}

# Fail fast, before minutes of building, where no GPU or no CUDA build can be had.
need_gpu() {
    if [ "${KVC_CUDA:-1}" = "0" ]; then
        note "KVC_CUDA=0 is set: the CUDA backend would not be built, and '$1' needs it. Nothing was run."
        exit 3
    fi
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        note "no NVIDIA GPU here (nvidia-smi missing or it found no device): '$1' runs on the GPU machine. Nothing was run."
        exit 3
    fi
    if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
        note "no nvcc here: the CUDA backend cannot be built. Nothing was run."
        exit 3
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/gpu: /' | tee -a "$SUMMARY"
}

NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
ARCH=${KVC_CUDA_ARCH:-90}

# The CUDA objects, compiled in parallel (setup.py's nvcc runs one file at a time) where setup.py looks for
# them (build_temp of this Python); setup.py then reuses every object newer than its sources and links.
# The flags are setup.py's (_build_cuda; one arch here). Objects compiled from other sources (a hash of
# csrc/, setup.py and the arch) are compiled again. $1: the build_temp folder.
cuda_objects() {
    local tmp=$1 src_hash
    src_hash=$( (find csrc -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' \) -print0 | sort -z | xargs -0 sha256sum
                 sha256sum setup.py; echo "$ARCH") | sha256sum | cut -c1-16)
    mkdir -p "$tmp/csrc"
    if [ "$(cat "$tmp/cuda_sources.sha" 2>/dev/null)" = "$src_hash" ]; then
        echo "CUDA objects in $tmp were compiled from these sources: reused"
    else
        echo "compiling the CUDA objects into $tmp ($(nproc) at a time)"
        # shellcheck disable=SC2016  # expanded by the inner sh
        find csrc -name '*.cu' | sort | xargs -P "$(nproc)" -I{} sh -c \
            'mkdir -p "$(dirname "$1/$2.o")" && "$3" -O3 -std=c++17 -Xcompiler -fPIC,-fvisibility=hidden \
             -gencode=arch=compute_$4,code=sm_$4 -DKVC_WITH_CUDA=1 -Icsrc/include -c "$2" -o "$1/$2.o"' \
            _ "$tmp" {} "$NVCC" "$ARCH" || return 1
        echo "$src_hash" >"$tmp/cuda_sources.sha"
    fi
    cudnn_object "$tmp"
    # the arch stamp setup.py compares, then the objects after it (carried or copied files get new mtimes)
    printf '%s' "$ARCH" >"$tmp/csrc/cuda_arch.txt"
    sleep 1
    find "$tmp/csrc" -name '*.o' -exec touch {} +
}

# The cuDNN attention's object and the libcudnn.so.9 loader stub it links against, from the headers a local build put
# in build/cudnn (`setup.py fetch_cudnn` in prebuild downloads them; the device cannot): setup.py there only links it.
cudnn_object() {
    local tmp=$1 fe=build/cudnn/frontend/include inc=build/cudnn/cudnn/include
    if [ -f "$tmp/csrc/backend/cudnn/sdpa_cudnn.cpp.o" ] && [ "$tmp/csrc/backend/cudnn/sdpa_cudnn.cpp.o" -nt csrc/backend/cudnn/sdpa_cudnn.cpp ]; then
        return 0
    fi
    if [ ! -f "$fe/cudnn_frontend.h" ] || [ ! -f build/cudnn/cudnn/lib/libcudnn.so.9 ]; then
        echo "no cuDNN headers in build/cudnn: the cuDNN attention is not prebuilt (its tests will skip)"
        return 0
    fi
    mkdir -p "$tmp/csrc/backend/cudnn" "$tmp/cudnn_lib"
    cp build/cudnn/cudnn/lib/libcudnn.so.9 "$tmp/cudnn_lib/"
    "$NVCC" -O2 -std=c++17 -x cu -Xcompiler -fPIC,-fvisibility=hidden -gencode=arch=compute_"$ARCH",code=sm_"$ARCH" \
        -I"$fe" -I"$inc" -c csrc/backend/cudnn/sdpa_cudnn.cpp -o "$tmp/csrc/backend/cudnn/sdpa_cudnn.cpp.o"
}

# libcudnn.so.9 of the image's PyTorch (nvidia-cudnn-cu13), for the CUDA backend's run-time load (KVC_CUDNN)
cudnn_env() {
    [ -n "${KVC_CUDNN:-}" ] && return 0
    KVC_CUDNN=$($PY - <<'PYEOF' 2>/dev/null
import glob, importlib.util, os
spec = importlib.util.find_spec("nvidia")
for d in (spec.submodule_search_locations if spec else []):
    for f in sorted(glob.glob(os.path.join(d, "*", "lib", "libcudnn.so.9"))):
        print(f)
        raise SystemExit
PYEOF
)
    export KVC_CUDNN
    note "cuDNN: ${KVC_CUDNN:-not found (the cudnn attention rows will say why)}"
}

build() {
    local h
    h=$( (find csrc python -type f -print0 | sort -z | xargs -0 sha256sum; sha256sum setup.py) | sha256sum | cut -c1-16)
    if [ -f kvpress_c/libkvpress_c_cuda.so ] && [ "$(cat build/.kvc_built 2>/dev/null)" = "$h" ] \
        && $PY -c 'import sys, kvpress_c; sys.exit(0 if kvpress_c.cuda_available() else 1)' 2>/dev/null; then
        note "build: reused (this machine built these sources in an earlier call)"
        cudnn_env
        return 0
    fi
    local tmp
    tmp=$($PY -c 'import sys, sysconfig; print(f"build/temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")')
    step cuda-objects 300 build.log bash "$SELF" _cuda-objects "$tmp" || { tail -30 "$OUT/build.log"; note "build FAILED (log build.log)"; finish; }
    KVC_CUDNN_FETCH=0 KVC_CUDA_ARCH=$ARCH step build 200 build.log "$PY" setup.py -q build_ext --inplace \
        || { tail -30 "$OUT/build.log"; note "build FAILED (log build.log)"; finish; }
    if ! $PY -c 'import sys, kvpress_c; from kvpress_c import device_info; print("cuda:", device_info("cuda")); sys.exit(0 if kvpress_c.cuda_available() else 1)' 2>&1 | tee -a "$OUT/build.log"; then
        note "built, but the CUDA backend is not available (see the end of build.log)"
        FAILED=3
        finish
    fi
    mkdir -p build && echo "$h" >build/.kvc_built
    cudnn_env
}

wheels() {  # kvpress 0.5.x fails on transformers >= 5.3 (the GPU image has 5.17)
    if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvp52 .whl/*.whl \
            && export PYTHONPATH=/tmp/kvp52${PYTHONPATH:+:$PYTHONPATH}
    else
        note "no .whl/: the kvpress columns will be missing (run 'benchmarks/gpu_session.sh fetch-wheels' here first, carry .whl)"
    fi
}

# pytest's own per-test limit where pytest-timeout is installed (the GPU image has it)
per_test_timeout() { $PY -c 'import pytest_timeout' 2>/dev/null && echo "--timeout=$1"; }

# The device tests of item 3 (every file, -k cuda) and the kernel cases the sanitizers run (small shapes).
DEVICE_TESTS=(tests/device tests/press/test_think_freed.py)
SANITIZE_K="cuda and (test_matmul and 7-33-65 or test_rmsnorm_with_residual and 37-576 or test_rope and 64-8-128-1 \
or test_swiglu and 33-1536 or test_attention_ragged and (100-8-2-128 or 40-4-2-80) or test_topk_with_ties_and_nan and 1000 \
or test_head_rmsnorm and 37-8-64 or test_attention_window_starts and 70-8-64)"

sanitizer() {
    command -v compute-sanitizer 2>/dev/null && return
    local c
    for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
        [ -x "$c" ] && echo "$c" && return
    done
}

# The Llama-3.1-8B-shaped tests (HF logits parity, TAKE at 128k within the weights + 3 GB) for at most $1 seconds
tests_8b() {
    step test8b "$1" test_device_8b.log "$PY" -m pytest -q -rfEs -s -p no:cacheprovider \
        --junitxml="$OUT/test_device_8b.xml" -k llama8b tests/device/test_device.py
    grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$OUT/test_device_8b.log" | tail -1 | sed 's/^/8b tests: /' | tee -a "$SUMMARY"
}

case "${1:-}" in
fetch-wheels)
    rm -rf .whl && mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl transformers==5.2.0 kvpress==0.5.5 cachetools datasets dill multiprocess fire termcolor || exit 1
    du -sh .whl
    ;;
prebuild)  # here: the CUDA objects for the device's Python 3.12 (objects do not depend on Python; the path does)
    BUDGET=1200
    "$PY" setup.py -q fetch_cudnn || echo "no cuDNN build inputs: the cuDNN attention is not prebuilt"
    step cuda-objects 1200 build.log bash "$SELF" _cuda-objects build/temp.linux-x86_64-cpython-312 || exit 1
    du -sh build
    ;;
_cuda-objects)  # inside step's timeout (a function cannot run under `timeout`)
    cuda_objects "$2"
    ;;
test)
    BUDGET=${KVC_SESSION_BUDGET:-300}
    need_gpu test
    build
    wheels
    k=$(per_test_timeout 60)
    # every device test on cuda (-x off): a failure does not stop the others
    step device-tests "$(upto 190 90)" device_tests.log "$PY" -m pytest -q -rfEs -p no:cacheprovider ${k:+"$k"} \
        --junitxml="$OUT/device_tests.xml" -k "cuda and not llama8b" "${DEVICE_TESTS[@]}"
    grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$OUT/device_tests.log" | tail -1 | sed 's/^/device tests: /' | tee -a "$SUMMARY"
    san=$(sanitizer)
    if [ -n "$san" ]; then
        for tool in memcheck racecheck; do
            [ "$tool" = memcheck ] && r=60 || r=30  # what the steps after it take
            step "$tool" "$(upto 30 "$r")" "$tool.log" "$san" --tool "$tool" --target-processes all --print-limit 20 --error-exitcode 9 \
                "$PY" -m pytest -q -p no:cacheprovider -k "$SANITIZE_K" tests/device/test_device.py
            grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -1 | sed "s/^/$tool: /" | tee -a "$SUMMARY"
        done
    else
        note "compute-sanitizer not found: memcheck and racecheck not run"
        FAILED=1
    fi
    step tolerance 30 device_tests.log "$PY" benchmarks/device_tolerance.py --device cuda --seeds 10 \
        --out "$OUT/device_tolerance_cuda.json"
    finish
    ;;
test8b)
    BUDGET=${KVC_SESSION_BUDGET:-300}
    need_gpu test8b
    build
    wheels
    tests_8b 290
    finish
    ;;
bench)
    BUDGET=${KVC_SESSION_BUDGET:-390}
    need_gpu bench
    build
    wheels
    # the 16 GB model first (its own line in the summary: reused on a warm machine), then 8k and 32k with every
    # seed press (and the per-kernel TFLOP/s), both systems; then decode; then the 8B tests on the same model
    step model-8b "$(upto 90 275)" bench.log "$PY" -c 'import sys; sys.path.insert(0, "tests/support")
from random_llama import llama31_8b_dir, write_llama31_bf16; print("8B-shaped model:", write_llama31_bf16(llama31_8b_dir()))'
    step prefill-8k-32k "$(upto 135 140)" bench.log "$PY" benchmarks/gpu_prefill.py --lengths 8192 32768 --repeats 2
    cp benchmarks/results/gpu_prefill.json "$OUT/gpu_prefill.json" 2>/dev/null
    cp benchmarks/results/gpu_prefill.md "$OUT/tables.md" 2>/dev/null
    step decode "$(upto 45 95)" bench.log "$PY" benchmarks/gpu_decode.py --contexts 8192 32768 --steps 32
    cp benchmarks/results/gpu_decode.json "$OUT/gpu_decode.json" 2>/dev/null
    { echo; cat benchmarks/results/gpu_decode.md; } >>"$OUT/tables.md" 2>/dev/null
    tests_8b 95
    finish
    ;;
bench-opt)
    BUDGET=${KVC_SESSION_BUDGET:-510}
    need_gpu bench-opt
    build
    KVC_ATTN_MMA=1 step prefill-mma 160 bench.log "$PY" benchmarks/gpu_prefill.py --systems kvpress_c --lengths 8192 32768
    cp benchmarks/results/gpu_prefill.json "$OUT/gpu_prefill_mma.json" 2>/dev/null
    KVC_ATTN_KERNEL=cudnn step prefill-cudnn 160 bench.log "$PY" benchmarks/gpu_prefill.py --systems kvpress_c --lengths 8192 32768
    cp benchmarks/results/gpu_prefill.json "$OUT/gpu_prefill_cudnn.json" 2>/dev/null
    KVC_DECODE_GRAPHS=1 step decode-graphs 160 bench.log "$PY" benchmarks/gpu_decode.py --systems kvpress_c
    cp benchmarks/results/gpu_decode.json "$OUT/gpu_decode_graphs.json" 2>/dev/null
    finish
    ;;
bench-kv)
    # issue 27: decode by K/V cache type at 2k, 8k and 32k (full cache and SnapKV), graphs on, kvpress_c only
    BUDGET=${KVC_SESSION_BUDGET:-510}
    need_gpu bench-kv
    build
    KVC_DECODE_GRAPHS=1 step decode-kv-types 470 bench.log "$PY" benchmarks/gpu_decode.py --systems kvpress_c \
        --contexts 2048 8192 32768 --presses full snapkv --steps 32 --kv-caches native f16 q8_0 kivi4 kivi2
    cp benchmarks/results/gpu_decode_kv.json "$OUT/gpu_decode_kv.json" 2>/dev/null
    cp benchmarks/results/gpu_decode_kv.md "$OUT/tables.md" 2>/dev/null
    finish
    ;;
bench128k)
    BUDGET=${KVC_SESSION_BUDGET:-540}
    need_gpu bench128k
    build
    wheels
    # the issue's 128k targets first (the full cache, SnapKV, TAKE), then the other presses with what is left
    step prefill-128k 300 bench.log "$PY" benchmarks/gpu_prefill.py --lengths 131072 --presses full snapkv take
    cp benchmarks/results/gpu_prefill.json "$OUT/gpu_prefill_128k.json" 2>/dev/null
    cp benchmarks/results/gpu_prefill.md "$OUT/tables.md" 2>/dev/null
    step prefill-128k-rest 300 bench.log "$PY" benchmarks/gpu_prefill.py --lengths 131072 --presses adakv chunkkv edie_tada
    cp benchmarks/results/gpu_prefill.json "$OUT/gpu_prefill_128k_rest.json" 2>/dev/null
    { echo; cat benchmarks/results/gpu_prefill.md; } >>"$OUT/tables.md" 2>/dev/null
    finish
    ;;
*)
    echo "usage: $0 fetch-wheels | prebuild | test | test8b | bench | bench-opt | bench-kv | bench128k"
    exit 2
    ;;
esac
