#!/usr/bin/env bash
# Rows of the paper's recipe one at a time, each with the GPU to itself, in a queue that outlives the device call that
# starts it. One at a time, because two BF16 recipe runs sharing an H200 trained no faster together than one alone
# (results/stabilisers/h200-2026-12-03c: 2 × 162k tokens/s against about 350k alone before the second started). FP32
# rows did gain from sharing an H200 (page 17's plan gives both), though not an H100, where two FP32 rows together
# logged about 2 × 131k tokens/s against about 300k for one alone; so a step of the queue may be rows joined by "+",
# which share the GPU: ONLY="sr_s1 fp32_qknorm_s1+fp32_gated_s1" runs sr_s1, then the two FP32 rows together. A step may end
# in "@N": its rows stop at step N (stop_at_step, after EXTRA's), e.g. "bf16_qknorm_s1@5000" to rerun a row only as far
# as the doctor's checkpoint; its archive's name then ends in "_toN".
#
#   export LPFA_GIT_COMMIT=<full hash>   # the device's copy of the tree has no .git; each run's config.json records it
#   PHASE=start  ONLY="bf16_qknorm_s1 sr_s1" EXPERIMENT=stabilisers EXTRA="stop_at_step=6200" bash scripts/gpu/in_turn.sh
#   PHASE=follow MAX_S=560 bash scripts/gpu/in_turn.sh   # progress; each finished step's archive to $OUT
#   PHASE=stop bash scripts/gpu/in_turn.sh               # end it: stop the running rows, start no further step
#
# start copies src/, scripts/ and the data (DATA, default data/corpus) into QUEUE/tree (QUEUE: /tmp/in_turn), so that
# later device calls, which rewrite the working tree and the carried data, never touch what the queue runs or reads,
# then starts the queue detached (setsid) and returns. The queue runs each step of ONLY in order through
# scripts/gpu/paper_recipe.sh: PHASE=start (BATCH, default 24, so no probe; BUDGET, default 900 s) and then
# PHASE=finish (with DOCTOR_STEP and the script's other variables as given here), under the launch name NAME_<step>
# (NAME: in_turn; a step's "+" becomes "-"), so each step's archive, QUEUE/done/NAME_<step>.tar.gz, stands alone. A
# step that fails does not stop the queue. follow waits up to MAX_S seconds for the queue to end, printing each running row's last log line every
# POLL seconds (60), then copies the finished archives and in_turn_logs.tar.gz (the queue's log and each row's) to
# $OUT. The device tool brings back at most 8 files a call: follow at least every 6 steps. stop asks the running step's
# rows to end cleanly (a STOP file in each run folder: lpfa.train stops with its logs, summary and a checkpoint) and
# the queue to start no further step; the stopped step still finishes (its doctor, replay and archive) before the
# queue ends, and follow brings it back. follow also brings in_turn_partial.tar.gz, the small files (config, log, metrics,
# reports) of the steps still running, so that a machine taken back mid-step loses no more than their checkpoints.
set -u
QUEUE=${QUEUE:-/tmp/in_turn}; NAME=${NAME:-in_turn}; ROOT=${ROOT:-/tmp/runs}; OUT=${OUT:-/tmp/out}
export ROOT
case ${PHASE:?PHASE must be start, follow, stop or queue} in
start)
  : "${ONLY:?ONLY must name the rows to run, in order}"
  if [ -f "$QUEUE/queue.pid" ] && kill -0 "$(cat "$QUEUE/queue.pid")" 2>/dev/null; then
    echo "a queue is already running from $QUEUE (pid $(cat "$QUEUE/queue.pid")): follow it, or give the machine back"
    exit 1
  fi
  for step in $ONLY; do
    case $step in *@*) [[ ${step##*@} =~ ^[0-9]+$ ]] || { echo "ONLY step $step: expected LABEL[+LABEL...][@STEP], STEP a number"; exit 2; };; esac
  done
  DATA=${DATA:-data/corpus}
  [ -d "$DATA" ] || { echo "DATA=$DATA: expected a folder of train.bin(.xz) and val.bin(.xz)"; exit 1; }
  rm -rf "$QUEUE" && mkdir -p "$QUEUE/tree" "$QUEUE/done" || exit 1
  cp -r src scripts "$QUEUE/tree/" && cp -r "$DATA" "$QUEUE/tree/data" || exit 1
  (cd "$QUEUE/tree" || exit 1  # (the detached command alone in the background: it holds none of this call's output)
   DATA="$QUEUE/tree/data" PHASE=queue setsid bash scripts/gpu/in_turn.sh > "$QUEUE/queue.log" 2>&1 < /dev/null &
   echo $! > "$QUEUE/queue.pid")
  echo "queue started (pid $(cat "$QUEUE/queue.pid")): $ONLY; log $QUEUE/queue.log"
  ;;
queue)  # (run by start, detached, from QUEUE/tree)
  for step in $ONLY; do  # a step: one row, or rows joined by "+" that share the GPU, then "@N" to stop them at step N
    if [ -f "$QUEUE/stop" ]; then echo "$(date -u +%FT%TZ) stopped before $step"; break; fi
    rows=${step%@*}; stop=; [ "$rows" = "$step" ] || stop=${step##*@}
    label=${rows//+/-}${stop:+_to$stop}
    echo "$(date -u +%FT%TZ) start ${rows//+/ and }${stop:+ to step $stop}"
    NAME="${NAME}_$label" ONLY="${rows//+/ }" BATCH="${BATCH:-24}" BUDGET="${BUDGET:-900}" \
      EXTRA="${EXTRA:-}${stop:+ stop_at_step=$stop}" \
      WAIT="$(( ${BUDGET:-900} + 600 ))" PHASE=start bash scripts/gpu/paper_recipe.sh > "$QUEUE/$label.log" 2>&1
    NAME="${NAME}_$label" PHASE=finish WAIT=120 POLL=10 OUT="$QUEUE/done" bash scripts/gpu/paper_recipe.sh \
      >> "$QUEUE/$label.log" 2>&1
    echo "$(date -u +%FT%TZ) done ${rows//+/ and } (finish exit $?)"
  done
  echo "$(date -u +%FT%TZ) queue ended"
  touch "$QUEUE/ended"
  ;;
follow)
  [ -f "$QUEUE/queue.log" ] || { echo "no queue under $QUEUE: start one with PHASE=start"; exit 1; }
  MAX_S=${MAX_S:-560}; POLL=${POLL:-60}; t0=$SECONDS; last=-$POLL
  while [ ! -f "$QUEUE/ended" ] && [ $(( SECONDS - t0 )) -lt "$MAX_S" ]; do
    if [ $(( SECONDS - last )) -ge "$POLL" ]; then
      last=$SECONDS
      echo "$(date -u +%T) $(tail -1 "$QUEUE/queue.log")"
      for f in "$ROOT/${NAME}_"*/*/log.txt; do
        [ -f "$f" ] && [ ! -f "$(dirname "$f")/summary.json" ] && echo "  $(basename "$(dirname "$f")"): $(tail -1 "$f")"
      done
    fi
    sleep 5
  done
  cat "$QUEUE/queue.log"
  mkdir -p "$OUT"
  cp "$QUEUE"/done/*.tar.gz "$OUT"/ 2>/dev/null
  (cd "$QUEUE" && tar -czf "$OUT/in_turn_logs.tar.gz" ./*.log)
  # the steps not finished yet: their run folders' small files so far (config, log, metrics, and any doctor or replay
  # report written), so that a machine taken back mid-step loses its checkpoints, not what the rows have measured
  partial=(); rm -f "$OUT/in_turn_partial.tar.gz"
  for d in "$ROOT/${NAME}_"*/; do
    [ -d "$d" ] && [ ! -f "$QUEUE/done/$(basename "$d").tar.gz" ] && partial+=("$(basename "$d")")
  done
  if [ ${#partial[@]} -gt 0 ]; then
    (cd "$ROOT" && find "${partial[@]}" \( -name ckpt -o -name ckpt_history \) -prune -o -type f \
       \( -name '*.json' -o -name '*.jsonl' -o -name '*.txt' -o -name '*.log' -o -name '*.md' \) -print |
     tar -czf "$OUT/in_turn_partial.tar.gz" -T -)
  fi
  ls "$OUT"
  ;;
stop)
  [ -f "$QUEUE/queue.log" ] || { echo "no queue under $QUEUE: nothing to stop"; exit 1; }
  touch "$QUEUE/stop"
  for d in "$ROOT/${NAME}_"*/*/; do  # the running rows: a run folder without its summary yet
    [ -f "$d/config.json" ] && [ ! -f "$d/summary.json" ] && touch "$d/STOP" && echo "asked to stop: $d"
  done
  echo "the queue starts no further step; PHASE=follow brings back the stopped step once it has finished"
  ;;
*)
  echo "PHASE=$PHASE: expected start, follow, stop or queue"; exit 2
  ;;
esac
