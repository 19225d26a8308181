#!/usr/bin/env bash
# Issue 17 on one idle GPU, in one device call of at most 10 minutes: the kernels' correctness on the GPU, their
# speed through the op and alone, each step under its own time limit so that a slow one cannot starve the next.
#
#   bash scripts/gpu/kernels.sh          # results in $OUT/bench, $OUT/tune, $OUT/gpu_tests.txt
#
# Steps (seconds each, all adjustable): BENCH_S (240) benchmarks/attention.py --parts $PARTS (overhead,check,speed,shapes),
# TUNE_S (150) benchmarks/tune_attention.py ($TUNE_ARGS, default --quick), TESTS_S (180) tests/test_attention_gpu.py
# (-k "$TESTS_K" when set), SFA_S (120) benchmarks/sfa_overhead.py (SFA's forward cost: results/sfa_overhead/<run>).
# Run it with the GPU to itself: a shared GPU makes the timings meaningless. Each step
# writes its own provenance.json (the tests: the device line at the end of gpu_tests.txt). Commit the folders
# under results/attention_benchmark/<run> and results/attention_tuning/<run>.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv,noheader
timeout "${BENCH_S:-240}" $PY benchmarks/attention.py --out "$OUT/bench" --parts "${PARTS:-overhead,check,speed,shapes}" 2>&1 \
    | grep -v "^check \|^error " | tail -45
timeout "${TUNE_S:-150}" $PY benchmarks/tune_attention.py --out "$OUT/tune" ${TUNE_ARGS:---quick} 2>&1 | tail -20
timeout "${SFA_S:-120}" $PY benchmarks/sfa_overhead.py --out "$OUT/sfa" 2>&1 | tail -20
timeout "${TESTS_S:-180}" $PY -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py ${TESTS_K:+-k "$TESTS_K"} \
    > "$OUT/gpu_tests.txt" 2>&1
echo "exit $? (124: cut by TESTS_S)" >> "$OUT/gpu_tests.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/gpu_tests.txt"
grep -v "^\.*$" "$OUT/gpu_tests.txt" | tail -25
