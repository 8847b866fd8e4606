#!/usr/bin/env bash
# A GPU session's checks in few device calls (device time is scarce): build for sm_90, the GPU tests,
# then TTFT and decode against kvpress on the same GPU. One step per device call (each ends inside
# the device's 10 minutes); the build and the 16 GB 8B-shaped model in /tmp are kept between calls
# on a warm machine.
#
#   benchmarks/gpu_session.sh fetch-wheels   # here, once: kvpress 0.5.5 + transformers 5.2 and what they
#                                            # import that the GPU image lacks, into .whl/ (in .gitignore)
#   bash benchmarks/gpu_session.sh test      # on the GPU machine (device run, carry [".whl"]): build + the
#                                            # device tests on small models (emulated and cuda), the
#                                            # cuda-vs-cpu logits tolerance measured
#   bash benchmarks/gpu_session.sh test8b    # the 8B-shaped tests: HF logits parity, TAKE at 128k
#   bash benchmarks/gpu_session.sh bench     # TTFT 8k/32k and decode, kvpress_c (defaults) and kvpress
#   bash benchmarks/gpu_session.sh bench-opt # the opt-in switches: mma prefill attention, decode graphs
#   bash benchmarks/gpu_session.sh bench128k # TTFT at 128k, both systems
#
# Logs and results go to $OUT (the device tool brings them back), else ./gpu_out.
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

results() { cp benchmarks/results/gpu_*.json benchmarks/results/gpu_*.md "$OUT/" 2>/dev/null; }

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
    timeout 420 $PY -m pytest -q -rs tests/device/test_device.py -k "not llama8b" 2>&1 | tee "$OUT/test_device.log"
    timeout 120 $PY benchmarks/device_tolerance.py --device cuda --seeds 10 \
        --out benchmarks/results/device_tolerance_cuda.json 2>&1 | tail -2 | tee "$OUT/device_tolerance.log"
    cp benchmarks/results/device_tolerance_cuda.json "$OUT/" 2>/dev/null
    ;;
test8b)
    [ -f kvpress_c/libkvpress_c_cuda.so ] || build
    wheels
    timeout 560 $PY -m pytest -q -rs -s tests/device/test_device.py -k llama8b 2>&1 | tee "$OUT/test_device_8b.log"
    ;;
bench)
    [ -f kvpress_c/libkvpress_c_cuda.so ] || build
    wheels
    timeout 330 $PY benchmarks/gpu_prefill.py --lengths 8192 32768 2>&1 | tee "$OUT/gpu_prefill.log"
    timeout 200 $PY benchmarks/gpu_decode.py 2>&1 | tee "$OUT/gpu_decode.log"
    results
    ;;
bench-opt)
    [ -f kvpress_c/libkvpress_c_cuda.so ] || build
    KVC_ATTN_MMA=1 timeout 240 $PY benchmarks/gpu_prefill.py --systems kvpress_c --lengths 8192 32768 \
        2>&1 | tee "$OUT/gpu_prefill_mma.log"
    KVC_DECODE_GRAPHS=1 timeout 240 $PY benchmarks/gpu_decode.py --systems kvpress_c 2>&1 | tee "$OUT/gpu_decode_graphs.log"
    results
    ;;
bench128k)
    [ -f kvpress_c/libkvpress_c_cuda.so ] || build
    wheels
    timeout 560 $PY benchmarks/gpu_prefill.py --lengths 131072 2>&1 | tee "$OUT/gpu_prefill_128k.log"
    results
    ;;
*)
    echo "usage: $0 fetch-wheels | test | test8b | bench | bench-opt | bench128k"
    exit 2
    ;;
esac
