#!/usr/bin/env bash
# On one idle GPU, in one device call of at most 10 minutes: the kernels' correctness on the GPU, their
# speed through the op and alone, and GPT-2 S training throughput, each step under its own time limit so that a slow
# one cannot starve the next.
#
#   bash scripts/gpu/kernels.sh          # results in $OUT/kernels.tar.gz: bench/, tune/, sfa/, train/, gpu_tests.txt
#
# Steps (seconds each, all adjustable): BENCH_S (240) benchmarks/attention.py --parts $PARTS $BENCH_ARGS (overhead,speed,shapes; the bit-level
# check against the reference is left to the GPU tests, as it takes minutes),
# HOST_S (90) benchmarks/host_overhead.py (the host's time per layer of the call), NCU_S (150) benchmarks/ncu_attention.py
# (Nsight Compute's counters per kernel of one forward+backward: what limits each),
# TUNE_S (150) benchmarks/tune_attention.py ($TUNE_ARGS, default --quick), SFA_S (120) benchmarks/sfa_overhead.py
# (SFA's forward cost), OPTF_S and OPTB_S (0 = skipped) benchmarks/kernel_options.py, forward and --kernel backward, with
# $OPTF_ARGS and $OPTB_ARGS (A/B of the kernels' options against their defaults, with a bit check), TRAIN_S (0 = skipped) benchmarks/train_throughput.py $TRAIN_ARGS (default --compile --profile: every
# backend eager, SDPA/fa2/paper also compiled), STAB_S (0 = skipped) benchmarks/stabiliser_cost.py --rows $STAB_ROWS (default
# the soft-cap rows and the recipe runs they are divided by: what the soft-cap's exp2 tanh and reciprocal cost in training),
# TESTS_S (180) tests/test_attention_gpu.py and tests/test_train_gpu.py (-k "$TESTS_K" when set), run first.
# LAUNCH (unset: the committed table) is a change of the launch table for the bench and train steps, e.g.
# LAUNCH="backward.dq_mode=ordered": a candidate table timed in place of the committed one (--launch; its provenance.json
# names it), so that one call measures the change before LAUNCHES is edited. A step whose seconds are 0 is skipped.
# Run it with the GPU to itself: a shared GPU makes the timings meaningless. Each step writes its own provenance.json
# (the tests: the device line at the end of gpu_tests.txt) and its log. The device tool returns at most 8 files of a
# call, so the steps write under $WORK (/tmp/kernels) and the folder is packed into $OUT/kernels.tar.gz after every
# step: a call cut by its limit keeps what the finished steps measured. Commit the folders under
# results/attention_benchmark/<run>, results/attention_ncu/<run> (the CSVs; page 12 reads them), results/attention_tuning/<run>, results/sfa_overhead/<run>,
# results/train_throughput/<run> and results/stabiliser_cost/<run>.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; WORK=${WORK:-/tmp/kernels}
mkdir -p "$OUT" "$WORK"
pack() { tar -czf "$OUT/kernels.tar.gz" -C "$WORK" . ; }
# step SECONDS NAME COMMAND...: run COMMAND under its limit (0: skip), its output in $WORK/NAME.log, then pack
step() { local s=$1 name=$2; shift 2; [ "$s" = 0 ] && return; echo "== $name ($s s)"; timeout "$s" "$@" > "$WORK/$name.log" 2>&1
         echo "exit $? (124: cut by its limit)" >> "$WORK/$name.log"; grep -v "^check \|^error \|^\.*$" "$WORK/$name.log" | tail -40; pack; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv,noheader | tee "$WORK/gpu.txt"
# The GPU tests compile dozens of kernel variants, which takes most of their time on a fresh machine (56 of 64 tests
# in 560 s at e121946, one process). With pytest-xdist (carried as wheels in .wheels: the run tool's carry=[".wheels"])
# they compile in TESTS_N processes at once.
if [ -d .wheels ] && ! $PY -c "import xdist" 2>/dev/null; then $PY -m pip install -q --no-index --find-links .wheels pytest-xdist; fi
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n ${TESTS_N:-8}")
step "${TESTS_S:-180}" gpu_tests $PY -m pytest -q -p no:cacheprovider $XDIST tests/test_attention_gpu.py tests/test_train_gpu.py ${TESTS_K:+-k "$TESTS_K"}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$WORK/gpu_tests.log"
step "${BENCH_S:-240}" bench $PY benchmarks/attention.py --out "$WORK/bench" --parts "${PARTS:-overhead,speed,shapes}" ${BENCH_ARGS:-} \
    ${LAUNCH:+--launch $LAUNCH}
step "${HOST_S:-90}" host $PY benchmarks/host_overhead.py --out "$WORK/host"
step "${NCU_S:-150}" ncu $PY benchmarks/ncu_attention.py --out "$WORK/ncu" ${NCU_ARGS:-}
step "${TUNE_S:-150}" tune $PY benchmarks/tune_attention.py --out "$WORK/tune" ${TUNE_ARGS:---quick}
step "${SFA_S:-120}" sfa $PY benchmarks/sfa_overhead.py --out "$WORK/sfa"
step "${OPTF_S:-0}" options_fwd $PY benchmarks/kernel_options.py --out "$WORK/options_fwd" ${OPTF_ARGS:-}
step "${OPTB_S:-0}" options_bwd $PY benchmarks/kernel_options.py --kernel backward --out "$WORK/options_bwd" ${OPTB_ARGS:-}
step "${TRAIN_S:-0}" train $PY benchmarks/train_throughput.py --out "$WORK/train" ${TRAIN_ARGS:---compile --profile} \
    ${LAUNCH:+--launch $LAUNCH}
step "${STAB_S:-0}" stabiliser_cost $PY benchmarks/stabiliser_cost.py --out "$WORK/stabiliser_cost" \
    --rows ${STAB_ROWS:-bf16_paper_recipe fp32_paper_recipe bf16_softcap fp32_softcap} --budget-s "$(( ${STAB_S:-0} / 2 ))"
