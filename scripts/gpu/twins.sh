#!/usr/bin/env bash
# The BF16 and FP32 twins on one GPU machine, in three device calls of at most 10 minutes each (the runs outlive them):
#
#   PHASE=start  BUDGET=1380 WAIT=560 bash scripts/gpu/twins.sh   # unpack data, start the twins, follow them
#   PHASE=wait   WAIT=570 bash scripts/gpu/twins.sh               # follow them; a partial copy goes to $OUT
#   PHASE=finish WAIT=240 bash scripts/gpu/twins.sh               # wait for the end (STOP=1 ends them now),
#                                                                 # replay the BF16 run, SFA β sweep, collect
# Variables: EXPERIMENT (twins; or isolation, seeds, sfa_muon, sizes: lpfa.launch.EXPERIMENTS; several: "isolation seeds"), NAME (twins),
# ROOT (/tmp/runs), PRESET (repro), DATA (data/corpus), EXTRA (more key=value for every run), POLL (seconds between
# progress lines; 60, 20 in finish),
# ONLY (labels of the experiment to start; default all), GPUS (device indices; default every GPU, runs placed
# round-robin), REPLAY (1: replay the bf16 run in finish), REPLAY_STEPS (200), REPLAY_MAX_S (150), GPU_TESTS (1: run
# tests/test_attention_gpu.py in finish), STRUCTURE (1: python -m lpfa.structure on every run's last checkpoint in
# finish: Figs. 8, 9 of the structure page). Shorter experiments: EXTRA="compile=true max_steps=8000" (faster:
# results/compile_throughput), e.g. EXPERIMENT=isolation or EXPERIMENT=seeds, judged by the logit-runaway verdict.
# RUNAWAY_STEPS=6500 adds a run bf16_runaway: the BF16 twin again, eager (BF16 runs are deterministic, so it retraces
# the committed twin exactly: results/repro_runaway) with every 1000-step checkpoint kept; finish then replays it from
# the checkpoint before its logit runaway, or before its first logit above the runaway threshold when the run ends
# too early for the verdict (instead of the bf16 run), for the mechanism pages. SAVE_QKV=N also writes the replayed
# layer's q, k, v, dO of N sequences of its first step (qkv.npz: benchmarks/kernel_bias.py --captured).
# The committed isolation table and seeds were one launch on a 4-GPU machine (results/isolation/*/provenance.json):
# EXPERIMENT="isolation seeds" NAME=iso_seeds EXTRA="compile=true max_steps=8000" RUNAWAY_STEPS=6500 BUDGET=1100.
# The device tool carries at most 64 MiB: the tracked results/ (about 40 MB) and the corpus (31 MB) are over it together,
# so leave results/ out of the call's tree (nothing here reads it): add /results/ to .git/info/exclude and
# `git rm -r -q --cached results` for the call, then `git reset -q` and remove the line (results/repro_runaway/h200x2-*).
# Results land in $OUT/$NAME.tar.gz. One run alone keeps an H200 busy; runs sharing a GPU each get about 1/n
# of its steps, so on a machine with several GPUs give each run its own.
set -u
NAME=${NAME:-twins}; ROOT=${ROOT:-/tmp/runs}; PRESET=${PRESET:-repro}; DATA=${DATA:-data/corpus}
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 LPFA_RUNS=$ROOT
PY=${PY:-python3}
L="$PY -m lpfa.launch"
case ${PHASE:?PHASE must be start, wait or finish} in
start)
  if [ -f "$DATA/train.bin.xz" ] && [ ! -f "$DATA/train.bin" ]; then (cd "$DATA" && xz -dkf train.bin.xz val.bin.xz) || exit 1; fi
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
  GPUS=${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr '\n' ' ')}
  EXPS=(); for e in ${EXPERIMENT:-twins}; do EXPS+=(--experiment "$e"); done  # lpfa.launch.EXPERIMENTS
  RA=(); [ -n "${RUNAWAY_STEPS:-}" ] && RA=(--run bf16_runaway attn_policy=paper_untiled ckpt_history=true compile=false \
      max_steps="$RUNAWAY_STEPS")
  $L start --name "$NAME" --preset "$PRESET" --set data="$DATA" time_budget_s="${BUDGET:?}" max_steps=40000 \
      ckpt_interval=1000 ${EXTRA:-} "${EXPS[@]}" ${ONLY:+--only $ONLY ${RUNAWAY_STEPS:+bf16_runaway}} "${RA[@]}" \
      ${GPUS:+--gpus $GPUS} || exit 1
  $L wait --name "$NAME" --max-s "${WAIT:?}" --poll-s "${POLL:-60}"
  ;;
wait)
  $L wait --name "$NAME" --max-s "${WAIT:?}" --poll-s "${POLL:-60}"
  $L collect --name "$NAME" --out "${OUT:-/tmp/out}"
  ;;
finish)
  [ "${STOP:-0}" = 1 ] && for d in "$ROOT/$NAME"/*/; do touch "$d/STOP"; done
  $L wait --name "$NAME" --max-s "${WAIT:?}" --poll-s "${POLL:-20}"
  [ -f "$DATA/train.bin.xz" ] && [ ! -f "$DATA/train.bin" ] && (cd "$DATA" && xz -dkf train.bin.xz val.bin.xz)  # a re-sent tree drops them
  LAST=$(( $(nvidia-smi -L 2>/dev/null | wc -l) - 1 )); [ "$LAST" -lt 0 ] && LAST=0  # replay on GPU 0, the rest on the last
  R=bf16; [ -d "$ROOT/$NAME/bf16_runaway" ] && R=bf16_runaway
  if [ "${REPLAY:-1}" = 1 ] && [ -d "$ROOT/$NAME/$R" ]; then  # the instrumented replay of the failing run (mechanism pages)
    CUDA_VISIBLE_DEVICES=0 $PY -m lpfa.replay --run "$ROOT/$NAME/$R" --out "$ROOT/$NAME/${R}_replay" \
        --steps "${REPLAY_STEPS:-200}" --max-s "${REPLAY_MAX_S:-150}" ${SAVE_QKV:+--save-qkv $SAVE_QKV} \
        >"$ROOT/$NAME/replay.log" 2>&1 &
  fi
  (
    for d in "$ROOT/$NAME"/*/; do  # the SFA β sweep wherever checkpoints were kept
      [ -d "$d/ckpt_history" ] && CUDA_VISIBLE_DEVICES=$LAST $PY -m lpfa.sfa_sweep --run "$d" --out "$d/sfa_sweep.json" 2>&1 \
          | grep -v "SFA sweep:" | tail -8
    done
    if [ "${STRUCTURE:-1}" = 1 ]; then  # Figs. 8, 9 on every run's last checkpoint (the structure page)
      for d in "$ROOT/$NAME"/*/; do
        [ -d "$d/ckpt" ] && CUDA_VISIBLE_DEVICES=$LAST $PY -m lpfa.structure --run "$d" --out "$d/structure.json" 2>&1 | tail -1
      done
    fi
    if [ "${GPU_TESTS:-1}" = 1 ]; then  # the kernels at full shapes on this GPU
      mkdir -p "${OUT:-/tmp/out}"
      CUDA_VISIBLE_DEVICES=$LAST $PY -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py >"${OUT:-/tmp/out}/gpu_tests.txt" 2>&1
      tail -3 "${OUT:-/tmp/out}/gpu_tests.txt"
    fi
  ) &
  wait
  [ -f "$ROOT/$NAME/replay.log" ] && grep -v "^replay:" "$ROOT/$NAME/replay.log" | tail -40
  $L status --name "$NAME"
  $L collect --name "$NAME" --out "${OUT:-/tmp/out}" --extra sfa_sweep.json structure.json replay.json replay.npz qkv.npz
  ;;
esac
