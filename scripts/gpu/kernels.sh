#!/usr/bin/env bash
# Issue 17 on one idle GPU, in one device call of at most 10 minutes: the kernels' correctness on the GPU, their
# speed through the op and alone, and GPT-2 S training throughput, each step under its own time limit so that a slow
# one cannot starve the next.
#
#   bash scripts/gpu/kernels.sh          # results in $OUT/kernels.tar.gz: bench/, tune/, sfa/, train/, gpu_tests.txt
#
# Steps (seconds each, all adjustable): BENCH_S (240) benchmarks/attention.py --parts $PARTS (overhead,speed,shapes; the bit-level
# check against the reference is left to the GPU tests, as it takes minutes),
# HOST_S (90) benchmarks/host_overhead.py (the host's time per layer of the call),
# TUNE_S (150) benchmarks/tune_attention.py ($TUNE_ARGS, default --quick), SFA_S (120) benchmarks/sfa_overhead.py
# (SFA's forward cost), TRAIN_S (0 = skipped) benchmarks/train_throughput.py $TRAIN_ARGS (default --compile: every
# backend eager, SDPA/fa2/paper also compiled), TESTS_S (180) tests/test_attention_gpu.py (-k "$TESTS_K" when set).
# Run it with the GPU to itself: a shared GPU makes the timings meaningless. Each step writes its own provenance.json
# (the tests: the device line at the end of gpu_tests.txt) and its log. The device tool returns at most 8 files of a
# call, so the steps write under $WORK (/tmp/kernels) and the folder is packed into $OUT/kernels.tar.gz after every
# step: a call cut by its limit keeps what the finished steps measured. Commit the folders under
# results/attention_benchmark/<run>, results/attention_tuning/<run>, results/sfa_overhead/<run> and
# results/train_throughput/<run>.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; WORK=${WORK:-/tmp/kernels}
mkdir -p "$OUT" "$WORK"
pack() { tar -czf "$OUT/kernels.tar.gz" -C "$WORK" . ; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv,noheader | tee "$WORK/gpu.txt"
timeout "${BENCH_S:-240}" $PY benchmarks/attention.py --out "$WORK/bench" --parts "${PARTS:-overhead,speed,shapes}" \
    > "$WORK/bench.log" 2>&1
grep -v "^check \|^error " "$WORK/bench.log" | tail -45; pack
timeout "${HOST_S:-90}" $PY benchmarks/host_overhead.py --out "$WORK/host" > "$WORK/host.log" 2>&1
head -8 "$WORK/host.log"; pack
timeout "${TUNE_S:-150}" $PY benchmarks/tune_attention.py --out "$WORK/tune" ${TUNE_ARGS:---quick} > "$WORK/tune.log" 2>&1
tail -20 "$WORK/tune.log"; pack
timeout "${SFA_S:-120}" $PY benchmarks/sfa_overhead.py --out "$WORK/sfa" > "$WORK/sfa.log" 2>&1
tail -20 "$WORK/sfa.log"; pack
if [ "${TRAIN_S:-0}" != 0 ]; then
  timeout "$TRAIN_S" $PY benchmarks/train_throughput.py --out "$WORK/train" ${TRAIN_ARGS:---compile} > "$WORK/train.log" 2>&1
  tail -15 "$WORK/train.log"; pack
fi
timeout "${TESTS_S:-180}" $PY -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py ${TESTS_K:+-k "$TESTS_K"} \
    > "$WORK/gpu_tests.txt" 2>&1
echo "exit $? (124: cut by TESTS_S)" >> "$WORK/gpu_tests.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$WORK/gpu_tests.txt"
grep -v "^\.*$" "$WORK/gpu_tests.txt" | tail -25; pack
