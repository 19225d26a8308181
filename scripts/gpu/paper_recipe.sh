#!/usr/bin/env bash
# The paper's GPT-2 S recipe (preset gpt2-s-paper: lr 1e-3, 2,000 warmup steps, cosine to 1e-5 over
# 600k steps, so flat through one GPU run) at the largest batch that still gives MIN_STEPS steps in one GPU run.
#
#   PHASE=start  BUDGET=1080 WAIT=300 bash scripts/gpu/paper_recipe.sh  # probe speed, pick the batch, start, follow
#   PHASE=wait   WAIT=580 bash scripts/gpu/paper_recipe.sh               # follow; a partial copy goes to $OUT
#   PHASE=finish WAIT=300 bash scripts/gpu/paper_recipe.sh               # wait for the end (STOP=1 ends them now), collect
#
# start: each twin (ONLY, default "bf16_paper_recipe fp32_paper_recipe"; lpfa.launch.PAPER_RECIPE) first trains for
# PROBE seconds (150) at batch 16 with torch.compile, one per GPU, as the real run will; the slowest twin's median
# tokens/s then sets the batch, lpfa.scaling.batch_for_steps(tokens/s, BUDGET, MIN_STEPS=8000, 1024). The probes' logs
# are collected with the runs (probe/*/log.txt). max_steps is left at the preset's 600k (the cosine horizon): the
# wall-clock BUDGET ends the runs. BATCH=N skips the probe (more seeds or the SFA twin at the committed twins' batch:
# ONLY="sfa_paper_recipe bf16_paper_recipe_s1" BATCH=24). Variables as scripts/gpu/twins.sh: NAME (paper_recipe), ROOT (/tmp/runs),
# DATA (data/corpus), GPUS (default every GPU, one twin each), EXTRA (more key=value for every run), POLL (60).
# The device tool carries at most 64 MiB: the tracked results/ (about 45 MB) and the corpus (31 MB) are over it
# together, so leave results/ out of the working tree for the calls (nothing here reads it):
#   git sparse-checkout set --no-cone '/*' '!/results/'   ...the calls, carry ["data/corpus"]...   git sparse-checkout disable
set -u
NAME=${NAME:-paper_recipe}; ROOT=${ROOT:-/tmp/runs}; DATA=${DATA:-data/corpus}
EXPERIMENT=${EXPERIMENT:-paper_recipe}  # or stabilisers (lpfa.experiments.STABILISERS: same preset, judged against these)
ONLY=${ONLY:-bf16_paper_recipe fp32_paper_recipe}
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 LPFA_RUNS=$ROOT
PY=${PY:-python3}
L="$PY -m lpfa.launch"
COMMON=(data="$DATA" compile=true ckpt_interval=0 explosion_stop=300 ${EXTRA:-})
# DOCTOR_STEP=N (e.g. 5000, the last diagnostics step before bf16_paper_recipe's explosion): keep a checkpoint every
# DOCTOR_EVERY steps (default N; ckpt_history) and, in finish, run `lpfa doctor` (DOCTOR_MAX_S, 180 s each) on each run's
# last one at or before step N and before its loss exploded (lpfa.run.Run.checkpoint_before_explosion: a run that
# explodes early still brings one back), so that every run brings back the links that need a checkpoint (the δ bias of
# paper, fa2 and its own policy against FP32, the rank-1 similarity, V's sign), not the checkpoint:
# doctor_step_NNNNNN/report.json and report.md per run, in the archive. (GPT-2 S: about 1.5 GB of disk per checkpoint.)
# DOCTOR_ARGS: more lpfa doctor options, e.g. "--batches 8 --seq-len 1024" for a probe that resolves a smaller δ bias
# (the default 4 × 256 tokens; rows compared on page 17 should share one probe).
# REPLAY_STEPS=N (e.g. 100; 0 = none): also replay each run's training for N steps from that same checkpoint with
# layer REPLAY_LAYER (1) instrumented (python -m lpfa.replay, cut after REPLAY_MAX_S - 60 s; REPLAY_MAX_S 240): the
# per-step δ error of Fig. 5, whose bias test (lpfa.replay.bias_test) resolves what one probe batch cannot; brings back
# replay_step_NNNNNN/replay.json (the numbers; not the arrays of the figures) and its log.
[ -n "${DOCTOR_STEP:-}" ] && COMMON+=(ckpt_interval="${DOCTOR_EVERY:-$DOCTOR_STEP}" ckpt_history=true)
case ${PHASE:?PHASE must be start, wait or finish} in
start)
  if [ -f "$DATA/train.bin.xz" ] && [ ! -f "$DATA/train.bin" ]; then (cd "$DATA" && xz -dkf train.bin.xz val.bin.xz) || exit 1; fi
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
  GPUS=${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader | tr '\n' ' ')}
  if [ -z "${BATCH:-}" ]; then
  $L start --name "$NAME/probe" --preset gpt2-s-paper --set "${COMMON[@]}" batch_size=16 grad_accum=1 \
      time_budget_s="${PROBE:-150}" eval_interval=0 --experiment "$EXPERIMENT" --only $ONLY --gpus $GPUS || exit 1
  $L wait --name "$NAME/probe" --max-s "$(( ${PROBE:-150} + 240 ))" --poll-s 30
  BATCH=$($PY - "$ROOT/$NAME/probe" "${BUDGET:?}" "${MIN_STEPS:-8000}" <<'EOF'
import sys
from pathlib import Path
from lpfa.scaling import batch_for_steps, compare_throughput
logs = {d.name: d / "log.txt" for d in sorted(Path(sys.argv[1]).iterdir()) if (d / "log.txt").is_file()}
speed = compare_throughput(logs, skip=100)
print(speed.to_string(), file=sys.stderr)
print(batch_for_steps(float(speed["median tokens/s"].min()), float(sys.argv[2]) - 90, int(sys.argv[3]), 1024))  # 90 s: compile
EOF
) || exit 1
  echo "batch_size=$BATCH (x 1024 tokens = $(( BATCH * 1024 )) tokens/step)" | tee "$ROOT/$NAME/probe/batch.txt"
  fi  # BATCH given: no probe (e.g. BATCH=24, the committed twins' batch, for more seeds or the SFA twin)
  $L start --name "$NAME" --preset gpt2-s-paper --set "${COMMON[@]}" batch_size="$BATCH" grad_accum=1 \
      time_budget_s="${BUDGET:?BUDGET (seconds per run) must be set}" --experiment "$EXPERIMENT" --only $ONLY --gpus $GPUS || exit 1
  $L wait --name "$NAME" --max-s "${WAIT:?}" --poll-s "${POLL:-60}"
  ;;
wait|finish)
  [ "$PHASE" = finish ] && [ "${STOP:-0}" = 1 ] && for d in "$ROOT/$NAME"/*/; do touch "$d/STOP"; done
  $L wait --name "$NAME" --max-s "${WAIT:?}" --poll-s "${POLL:-60}"
  mkdir -p "${OUT:-/tmp/out}"
  $L status --name "$NAME"
  X=()
  if [ "$PHASE" = finish ] && [ -n "${DOCTOR_STEP:-}" ]; then
    # the device tool carries data/corpus afresh into every call's tree, without the val.bin that start unpacked
    if [ -f "$DATA/val.bin.xz" ] && [ ! -f "$DATA/val.bin" ]; then (cd "$DATA" && xz -dkf val.bin.xz); fi
    finish_row() {  # lpfa doctor, then the replay, on the run folder $1
      local d=$1 step ck DOC REP
      # "STEP FOLDER" of the checkpoint to examine (lpfa.run.Run.checkpoint_before_explosion), or nothing
      read -r step ck < <($PY -c "import sys; from lpfa.run import Run; r = Run(sys.argv[1]); s = r.checkpoint_before_explosion(int(sys.argv[2])); print('' if s is None else f'{s} {r.checkpoints[s]}')" "$d" "$DOCTOR_STEP")
      [ -n "${step:-}" ] || { echo "doctor: $d has no checkpoint at or before step $DOCTOR_STEP and before an explosion"; return; }
      DOC=$(printf "doctor_step_%06d" "$step")
      echo "doctor: $ck"
      timeout "${DOCTOR_MAX_S:-180}" $PY -m lpfa.doctor "$ck" --data "$DATA" --out "$d/$DOC" ${DOCTOR_ARGS:-} > "$d/$DOC.log" 2>&1
      tail -3 "$d/$DOC.log"
      if [ "${REPLAY_STEPS:-0}" -gt 0 ]; then  # Fig. 5's bias test on this row: its training replayed from that checkpoint
        REP=$(printf "replay_step_%06d" "$step")
        echo "replay: $REPLAY_STEPS steps from step $step, layer ${REPLAY_LAYER:-1}"
        timeout "${REPLAY_MAX_S:-240}" $PY -m lpfa.replay --run "$d" --step "$step" --steps "$REPLAY_STEPS" \
          --layer "${REPLAY_LAYER:-1}" --max-s "$(( ${REPLAY_MAX_S:-240} - 60 ))" --out "$d/$REP" > "$d/$REP.log" 2>&1
        tail -2 "$d/$REP.log"
      fi
    }
    # the rows of a launch finish side by side on their GPU (each its doctor, then its replay): rows that shared the
    # GPU to train share it here too, and a machine taken back loses less
    for d in "$ROOT/$NAME"/*/; do
      [ -f "$d/config.json" ] && finish_row "$d" &
    done
    wait
    for d in "$ROOT/$NAME"/*/; do  # what the rows wrote, for collect (names relative to each run folder)
      for f in "$d"doctor_step_*/report.json "$d"doctor_step_*/report.md "$d"doctor_step_*.log \
               "$d"replay_step_*/replay.json "$d"replay_step_*.log; do
        [ -f "$f" ] && X+=("${f#"$d"}")
      done
    done
    [ ${#X[@]} -gt 0 ] && X=(--extra "${X[@]}")
  fi
  $L collect --name "$NAME" --out "${OUT:-/tmp/out}" "${X[@]}"
  if [ -d "$ROOT/$NAME/probe" ]; then  # (an if, not &&: a launch without probes must not end the script with status 1)
    (cd "$ROOT/$NAME" && tar -czf "${OUT:-/tmp/out}/probe.tar.gz" probe/*.txt probe/launch.json \
      probe/*/log.txt probe/*/config.json probe/*/summary.json probe/*/stdout.txt)
  fi
  ;;
esac
