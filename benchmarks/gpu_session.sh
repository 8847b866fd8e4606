#!/usr/bin/env bash
# A GPU session's checks in few device calls (device time is scarce): build for sm_90, the GPU tests,
# then TTFT and decode against kvpress on the same GPU.
#
#   benchmarks/gpu_session.sh fetch-wheels   # here, once: kvpress 0.5.5 + transformers 5.2 and what they
#                                            # import that the GPU image lacks, into .whl/ (in .gitignore)
#   bash benchmarks/gpu_session.sh test      # on the GPU machine (device run, carry [".whl"]): build + tests
#   bash benchmarks/gpu_session.sh bench     # same machine, next call: benchmarks (the build is kept)
#
# Logs and results go to $OUT (the device tool brings them back), else ./gpu_out. Each step has its
# own time limit so one call ends inside the device's 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE

wheels() {  # kvpress 0.5.x fails on transformers >= 5.3 (the GPU image has 5.17)
    if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvp52 .whl/*.whl \
            && export PYTHONPATH=/tmp/kvp52${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "no .whl/: the kvpress columns will be missing (run 'benchmarks/gpu_session.sh fetch-wheels' here first)"
    fi
}

build() {
    if ! timeout 400 $PY setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
        tail -40 "$OUT/build.log"
        echo "build failed (log: $OUT/build.log)"
        exit 1
    fi
    $PY -c "import kvpress_c as k; print('cuda_available:', k.cuda_available())" | tee -a "$OUT/build.log"
}

case "${1:-}" in
fetch-wheels)
    rm -rf .whl && mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl transformers==5.2.0 kvpress==0.5.5 cachetools datasets dill multiprocess fire || exit 1
    du -sh .whl
    ;;
test)
    build
    wheels
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    timeout 420 $PY -m pytest -q -rs tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log"
    ;;
bench)
    [ -f kvpress_c/libkvpress_c_cuda.so ] || build
    wheels
    timeout 330 $PY benchmarks/gpu_prefill.py --lengths 8192 32768 2>&1 | tee "$OUT/gpu_prefill.log"
    timeout 180 $PY benchmarks/gpu_decode.py 2>&1 | tee "$OUT/gpu_decode.log"
    cp benchmarks/results/gpu_*.json benchmarks/results/gpu_*.md "$OUT/" 2>/dev/null
    ;;
*)
    echo "usage: $0 fetch-wheels | test | bench"
    exit 2
    ;;
esac
