#!/usr/bin/env bash
# The kernel-bias audit on one GPU: "is your attention kernel biased?", with all three input families.
#
#   OUT=... bash scripts/gpu/kernel_bias.sh            # train, capture, audit; results in $OUT/kernel_bias/
#
# 1. The captured family (iii) needs q, k, v of layer 1 of our BF16 run just before its logit runaway. The eager
#    `repro` BF16 twin is deterministic (results/repro_runaway: bit-identical in three launches) and its layer-1 logits
#    first pass 1000 at step 6,400, so it is trained again to STEPS (6000) with a checkpoint there, and
#    `lpfa.replay --save-qkv N` writes that layer's q, k, v, dO of N sequences at step STEPS (qkv.npz).
# 2. `benchmarks/kernel_bias.py` then audits every kernel on the random and tied families at each T and on qkv.npz.
# Variables: ROOT (/tmp/runs), DATA (data/corpus), PRESET (repro), STEPS (6000), LAYER (1), SAVE_QKV (4), T ("256 1024"),
# BUDGET (seconds for the training, 1100), SKIP_TRAIN (1: use an existing $ROOT/kernel_bias/bf16 run).
# It can share a GPU with other runs: nothing here is timed.
set -u
ROOT=${ROOT:-/tmp/runs}; DATA=${DATA:-data/corpus}; PRESET=${PRESET:-repro}; STEPS=${STEPS:-6000}
export PYTHONPATH=src PYTHONUNBUFFERED=1 LPFA_RUNS=$ROOT
PY=${PY:-python3}
RUN=$ROOT/kernel_bias/bf16; OUT=${OUT:-/tmp/out}; DEST=$OUT/kernel_bias
mkdir -p "$DEST"
if [ -f "$DATA/train.bin.xz" ] && [ ! -f "$DATA/train.bin" ]; then (cd "$DATA" && xz -dkf train.bin.xz val.bin.xz) || exit 1; fi
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  # the bf16 twin of lpfa.experiments.TWINS, eager as results/repro_pair's, its checkpoint at STEPS
  $PY -m lpfa.launch start --name kernel_bias --preset "$PRESET" --set data="$DATA" max_steps="$STEPS" \
      time_budget_s="${BUDGET:-1100}" ckpt_interval=1000 compile=false ${EXTRA:-} --experiment twins --only bf16 || exit 1
  $PY -m lpfa.launch wait --name kernel_bias --max-s "$(( ${BUDGET:-1100} + 120 ))" --poll-s "${POLL:-60}"
fi
$PY -m lpfa.replay --run "$RUN" --out "$ROOT/kernel_bias/bf16_replay" --layer "${LAYER:-1}" --steps 1 --save-qkv "${SAVE_QKV:-4}" \
    >"$DEST/replay.log" 2>&1 || { tail -20 "$DEST/replay.log"; exit 1; }
CAP=$DEST/layer${LAYER:-1}_step$STEPS  # the family's name in the audit: captured:layer1_step6000
mkdir -p "$CAP" "$DEST/bf16"
cp "$ROOT/kernel_bias/bf16_replay/qkv.npz" "$ROOT/kernel_bias/bf16_replay/replay.json" "$CAP/"
cp "$RUN/summary.json" "$RUN/config.json" "$RUN/log.txt" "$RUN/metrics.jsonl" "$DEST/bf16/" 2>/dev/null
$PY benchmarks/kernel_bias.py --out "$DEST" --device "${DEVICE:-cuda}" --T ${T:-256 1024} \
    --captured "$CAP/qkv.npz" >"$DEST/audit.log" 2>&1
rc=$?
tail -40 "$DEST/audit.log"
exit $rc
