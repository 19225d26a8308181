#!/usr/bin/env bash
# Fig. 2 at the paper's scale, one run over every GPU of the machine with DDP (torchrun, NCCL).
#
#   PHASE=plan   TPS=254258 GPUS=8 bash scripts/gpu/paper_scale.sh   # print the plan (no GPU needed): batch, time
#   PHASE=start  LABEL=bf16 BUDGET=1440 WAIT=540 bash scripts/gpu/paper_scale.sh   # start detached, follow
#   PHASE=wait   LABEL=bf16 WAIT=580 bash scripts/gpu/paper_scale.sh   # follow; the small files go to $OUT
#   PHASE=finish LABEL=bf16 WAIT=300 bash scripts/gpu/paper_scale.sh   # wait for the end (STOP=1 ends it now), collect
#
# The preset is gpt2-s-paper (GPT-2 S, T = 1024, AdamW (0.9, 0.95), no weight decay, clip 1, peak lr 1e-3 after 2,000
# warmup steps, cosine to 1e-5 over 600k steps), torch.compile on, BF16 autocast with FP32 master weights. LABEL bf16
# trains attn_policy=paper, LABEL fp32 its FP32 twin (attn_policy=fp32_split, lpfa.experiments.FP32_TWIN), same seed, so the same batches.
# Tokens per step: TOKENS (default: the plan's choice, lpfa.scaling.paper_scale_plan, from TPS = one GPU's measured
# tokens/s, default the committed paper-recipe probe's slower twin, and EFFICIENCY, DDP scaling, default 1): the
# paper's 524,288 if step 6,600 fits BUDGET, else the authors' 327,680. A test run: STEPS=200 (max_steps) LABEL=probe.
# NCCL's NVLink multicast stays off. ROOT (/tmp/runs), DATA (data/corpus), EXTRA (more key=value), POLL (60).
set -u
ROOT=${ROOT:-/tmp/runs}; DATA=${DATA:-data/corpus}; LABEL=${LABEL:-bf16}; NAME=${NAME:-paper_scale}
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
OUTDIR="$ROOT/$NAME/$LABEL"
GPUS=${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)}
plan() {  # prints "MICRO ACCUM TOKENS" on stdout, the plan on stderr
  $PY - "$GPUS" "${TPS:-}" "${EFFICIENCY:-1}" "${BUDGET:-1440}" "${TOKENS:-}" <<'EOF'
import sys
from lpfa.scaling import compare_throughput, micro_batches, paper_scale_plan
gpus, tps, eff, budget, tokens = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
if not tps:  # the committed probe of the paper-recipe twins: one H200 each, torch.compile, batch 16
    from lpfa.results import run_dir
    probe = run_dir("paper_recipe", "h200x2-2026-11-30") / "probe"
    tps = compare_throughput({d.name: d / "log.txt" for d in sorted(probe.iterdir()) if (d / "log.txt").is_file()},
                             skip=100)["median tokens/s"].min()
plan = paper_scale_plan(float(tps), gpus=gpus, efficiency=eff, budget_s=budget)
print(f"{gpus} GPUs at {float(tps):,.0f} tokens/s each, DDP efficiency {eff:g}, budget {budget:.0f} s:", file=sys.stderr)
print(plan.to_string(), file=sys.stderr)
if tokens:
    t = int(tokens)
else:
    chosen = plan.index[plan["chosen"]]
    if not len(chosen):
        sys.exit(f"neither batch reaches step 6,600 in {budget:.0f} s on {gpus} GPUs: set TOKENS= to run anyway")
    t = int(plan.loc[chosen[0], "tokens/step"])
micro, accum = micro_batches(t, gpus)
print(micro, accum, t)
EOF
}
case ${PHASE:?PHASE must be plan, start, wait or finish} in
plan) plan >/dev/null ;;
start)
  if [ -f "$DATA/train.bin.xz" ] && [ ! -f "$DATA/train.bin" ]; then (cd "$DATA" && xz -dkf train.bin.xz val.bin.xz) || exit 1; fi
  read -r MICRO ACCUM TOKENS_PER_STEP < <(plan) || exit 1
  [ -n "${MICRO:-}" ] || exit 1
  case $LABEL in
    fp32) ATTN="attn_policy=fp32_split" ;;
    *) ATTN="attn_policy=paper" ;;
  esac
  mkdir -p "$OUTDIR"
  echo "$GPUS GPUs x micro-batch $MICRO x grad_accum $ACCUM x 1024 = $TOKENS_PER_STEP tokens/step ($ATTN)" | tee "$OUTDIR/plan.txt"
  # global batch_size = GPUs x micro-batch (lpfa.train splits it over the ranks)
  setsid $PY -m torch.distributed.run --standalone --nproc_per_node="$GPUS" -m lpfa.train --preset gpt2-s-paper \
      data="$DATA" "$ATTN" batch_size=$(( GPUS * MICRO )) grad_accum="$ACCUM" compile=true ckpt_interval=0 \
      explosion_stop=300 time_budget_s="${BUDGET:-1440}" ${STEPS:+max_steps=$STEPS} out_dir="$OUTDIR" progress=false \
      ${EXTRA:-} > "$OUTDIR/stdout.txt" 2>&1 < /dev/null &
  echo "started: $OUTDIR (pid $!)"
  PHASE=wait exec bash "$0"
  ;;
wait|finish)
  [ "$PHASE" = finish ] && [ "${STOP:-0}" = 1 ] && touch "$OUTDIR/STOP"
  end=$(( $(date +%s) + ${WAIT:?WAIT (seconds to follow) must be set} ))
  while [ "$(date +%s)" -lt "$end" ]; do
    tail -n 1 "$OUTDIR/log.txt" 2>/dev/null
    [ -f "$OUTDIR/summary.json" ] && break
    pgrep -f "out_dir=$OUTDIR" > /dev/null || { echo "no process left for $OUTDIR"; break; }
    sleep "${POLL:-60}"
  done
  mkdir -p "${OUT:-/tmp/out}/$LABEL"
  for f in config.json log.txt stdout.txt summary.json plan.txt; do [ -f "$OUTDIR/$f" ] && cp "$OUTDIR/$f" "${OUT:-/tmp/out}/$LABEL/"; done
  [ -f "$OUTDIR/metrics.jsonl" ] && gzip -9 -n -c "$OUTDIR/metrics.jsonl" > "${OUT:-/tmp/out}/$LABEL/metrics.jsonl.gz"
  tail -n 3 "$OUTDIR/log.txt" 2>/dev/null
  ;;
esac
