#!/usr/bin/env bash
# Issue 5/6 on one GPU machine, in three device calls of at most 10 minutes each (the runs outlive them):
#
#   PHASE=start  BUDGET=1380 WAIT=560 bash scripts/gpu/twins.sh   # unpack data, start the twins, follow them
#   PHASE=wait   WAIT=570 bash scripts/gpu/twins.sh               # follow them; a partial copy goes to $OUT
#   PHASE=finish WAIT=240 bash scripts/gpu/twins.sh               # wait for the end (STOP=1 ends them now),
#                                                                 # replay the BF16 run, SFA β sweep, collect
# Variables: EXPERIMENT (twins; or isolation, seeds, sfa_muon: lpfa.launch.EXPERIMENTS), NAME (twins),
# ROOT (/tmp/runs), PRESET (repro), DATA (data/corpus), EXTRA (more key=value for every run),
# REPLAY_STEPS (200), REPLAY_MAX_S (150). Results land in $OUT/$NAME.tar.gz. One run alone keeps an H200
# busy; runs started together share it (each gets about 1/n of the steps).
set -u
NAME=${NAME:-twins}; ROOT=${ROOT:-/tmp/runs}; PRESET=${PRESET:-repro}; DATA=${DATA:-data/corpus}
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 LPFA_RUNS=$ROOT
PY=${PY:-python3}
L="$PY -m lpfa.launch"
case ${PHASE:?PHASE must be start, wait or finish} in
start)
  if [ -f "$DATA/train.bin.xz" ] && [ ! -f "$DATA/train.bin" ]; then (cd "$DATA" && xz -dkf train.bin.xz val.bin.xz) || exit 1; fi
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  $L start --name "$NAME" --preset "$PRESET" --set data="$DATA" time_budget_s="${BUDGET:?}" max_steps=40000 \
      ckpt_interval=1000 ${EXTRA:-} --experiment "${EXPERIMENT:-twins}" || exit 1  # lpfa.launch.EXPERIMENTS
  $L wait --name "$NAME" --max-s "${WAIT:?}" --poll-s 60
  ;;
wait)
  $L wait --name "$NAME" --max-s "${WAIT:?}" --poll-s 60
  $L collect --name "$NAME" --out "${OUT:-/tmp/out}"
  ;;
finish)
  [ "${STOP:-0}" = 1 ] && for d in "$ROOT/$NAME"/*/; do touch "$d/STOP"; done
  $L wait --name "$NAME" --max-s "${WAIT:?}" --poll-s 20
  [ -f "$DATA/train.bin.xz" ] && [ ! -f "$DATA/train.bin" ] && (cd "$DATA" && xz -dkf train.bin.xz val.bin.xz)  # a re-sent tree drops them
  if [ -d "$ROOT/$NAME/bf16" ]; then  # the instrumented replay of the failing run (mechanism pages)
    $PY -m lpfa.replay --run "$ROOT/$NAME/bf16" --out "$ROOT/$NAME/bf16_replay" --steps "${REPLAY_STEPS:-200}" \
        --max-s "${REPLAY_MAX_S:-150}" 2>&1 | grep -v "^replay:" | tail -40
  fi
  for d in "$ROOT/$NAME"/*/; do  # the SFA β sweep wherever checkpoints were kept
    [ -d "$d/ckpt_history" ] && $PY -m lpfa.sfa_sweep --run "$d" --out "$d/sfa_sweep.json" 2>&1 | grep -v "SFA sweep:" | tail -8
  done
  $L status --name "$NAME"
  $L collect --name "$NAME" --out "${OUT:-/tmp/out}" --extra sfa_sweep.json replay.json replay.npz
  ;;
esac
