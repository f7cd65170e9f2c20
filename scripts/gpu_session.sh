#!/usr/bin/env bash
# Everything a lent GPU machine is for, as ONE prepared command (a session gets ~15 minutes
# of device time and one call may run at most 10), results copied to $OUT as they appear:
#
#   bash scripts/gpu_session.sh            # on the GPU machine (the device tool's `run`)
#   DEVICE=cpu DEADLINE=120 TRAIN_SIZE=256 ... bash scripts/gpu_session.sh   # a CPU dry run (tested)
#
# 1. data: RS-Fashion realisation 0 rendered by every resampling pipeline (in parallel);
# 2. train/fastpath.py: the training step and evaluation of rst_cnn_fb and the CNN under each
#    precision (float32, TF32, bfloat16 autocast) and conv method, alone on the GPU; its
#    fastest training setting is what every run below uses;
# 3. side by side on the one GPU until DEADLINE (then Ctrl-C: each run saves last.pt):
#    * the paper's protocol for rst_cnn_fb and cnn on RS-Fashion, N_tr 5000, 60 epochs, trial 0
#      (train/reproduce.py --budget full: the like-for-like number and the first table shards);
#    * the shipped models (INIT_DIR/NAME.pt) fine-tuned FT_EPOCHS epochs on TRAIN_SIZE images
#      rendered by the training resampling pipelines, tested on our split and on the held-out
#      Pillow pipeline (train/resampling.py's question, answered in the same run);
#    * tests/test_cuda.py.
# Comes back in $OUT: fastpath.md, fastpath.json, rst_cnn_fb.pt and cnn.pt (the fine-tuned
# best checkpoints, test results written in), reproduce.tgz (the protocol runs' folders:
# summary, metrics, last.pt to resume), results.tgz (logs and the fine-tunes' records).
#
# The machine has no apt and no internet: carry the Fashion-MNIST IDX files in .gpu_data/
# (mkdir -p .gpu_data && cp /usr/share/datasets/fashion-mnist/*.gz .gpu_data/).
set -uo pipefail

DEVICE="${DEVICE:-cuda}"
DEADLINE="${DEADLINE:-530}"          # seconds from the start of this script
TRAIN_SIZE="${TRAIN_SIZE:-20000}"    # the shipped models' N_tr
FT_EPOCHS="${FT_EPOCHS:-2}"
FT_LR="${FT_LR:-0.001}"
INIT_DIR="${INIT_DIR-models}"       # empty: the fine-tunes start from scratch (dry run)
REPRO_BUDGET="${REPRO_BUDGET:-full}"
REPRO_SIZES="${REPRO_SIZES:-5000}"
MODEL_ARGS="${MODEL_ARGS:-}"
LIMIT_TEST="${LIMIT_TEST:-}"
VAL_SIZE="${VAL_SIZE:-}"
FASTPATH_ARGS="${FASTPATH_ARGS:-}"
DATA_ROOT="${DATA_ROOT:-.gpu_data}"  # the Fashion-MNIST IDX files
OUT="${OUT:-$PWD/runs/gpu-out}"
WORK="${WORK:-/tmp/rstcnn-gpu}"
PY="${PY:-}"
if [[ -z "$PY" ]]; then
    for cand in /opt/torch/.venv/bin/python python3; do
        if command -v "$cand" >/dev/null 2>&1; then PY="$cand"; break; fi
    done
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export RSTCNN_DATA="$WORK/data"
mkdir -p "$OUT" "$WORK/logs" "$WORK/robust"
LOG="$WORK/logs/session.log"
log() { echo "[gpu +$((SECONDS))s] $*" | tee -a "$LOG"; }
TRAIN_PIPES=(bicubic bilinear bicubic-uint8 antialiased)

collect() {  # what has appeared so far -> $OUT (comes back even if the call is cut off)
    local name
    for name in rst_cnn_fb cnn; do
        [[ -f "$WORK/robust/$name/best.pt" ]] && cp -f "$WORK/robust/$name/best.pt" "$OUT/$name.pt.tmp" \
            && mv -f "$OUT/$name.pt.tmp" "$OUT/$name.pt"
    done
    for name in fastpath.md fastpath.json; do
        [[ -f "$WORK/fastpath/$name" ]] && cp -f "$WORK/fastpath/$name" "$OUT/$name"
    done
    [[ -d "$WORK/reproduce" ]] && (cd "$WORK" && tar czf "$OUT/reproduce.tmp" \
        --exclude='best.pt' reproduce) && mv -f "$OUT/reproduce.tmp" "$OUT/reproduce.tgz"
    (cd "$WORK" && tar czf "$OUT/results.tmp" logs $(ls -d robust/*/metrics.jsonl \
        robust/*/summary.json robust/*/train.log 2>/dev/null)) && mv -f "$OUT/results.tmp" "$OUT/results.tgz"
}

log "python $PY, device $DEVICE, deadline ${DEADLINE}s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tee -a "$LOG"

# 1. every pipeline's rendering of realisation 0, one process each
for pipe in "${TRAIN_PIPES[@]}" pillow; do
    "$PY" -c "
import sys
from rstmodel.data import RSConfig, load_rs
load_rs(RSConfig('rs-fashion', realisation=0, resampling='$pipe'), data_root=sys.argv[1])
" "$DATA_ROOT" >"$WORK/logs/prepare-$pipe.log" 2>&1 &
done
wait
log "data ready: $(ls "$RSTCNN_DATA"/rs-fashion/seed0/ 2>/dev/null | grep -c npz) renderings"

# 2. the fast path, alone on the device
extra=()
[[ -n "$MODEL_ARGS" ]] && extra+=(--model-arg "$MODEL_ARGS")
# shellcheck disable=SC2086
timeout 150 "$PY" train/fastpath.py --device "$DEVICE" --out "$WORK/fastpath" "${extra[@]}" $FASTPATH_ARGS \
    >"$WORK/logs/fastpath.log" 2>&1 || log "fastpath exit $?"
FLAGS=$(sed -n 's/^FLAGS: //p' "$WORK/logs/fastpath.log" | tail -1)
log "fastest training setting: flags '${FLAGS}'"
collect

# 3. the runs, side by side, each in its own process group (Ctrl-C reaches only it)
[[ -n "$LIMIT_TEST" ]] && extra+=(--limit-test "$LIMIT_TEST")
[[ -n "$VAL_SIZE" ]] && extra+=(--val-size "$VAL_SIZE")
repro_flags=()
[[ "$FLAGS" == *--bf16* ]] && repro_flags+=(--bf16)
[[ "$FLAGS" == *method=* ]] && repro_flags+=(--method "$(sed -n "s/.*method='\([a-z]*\)'.*/\1/p" <<<"$FLAGS")")
pids=()
for name in rst_cnn_fb cnn; do
    setsid "$PY" train/reproduce.py --data rs-fashion --budget "$REPRO_BUDGET" --models "$name" \
        --train-sizes $REPRO_SIZES --augment no --trials 1 --device "$DEVICE" --data-root "$DATA_ROOT" \
        "${repro_flags[@]}" --out "$WORK/reproduce" >"$WORK/logs/reproduce-$name.log" 2>&1 &
    pids+=($!)
    init=()
    [[ -n "$INIT_DIR" ]] && init=(--init "$INIT_DIR/$name.pt")
    run_flags="$FLAGS"  # the CNN has no conv method to choose (as reproduce.py)
    [[ "$name" == cnn ]] && run_flags=$(sed "s/--model-arg method='[a-z]*'//" <<<"$FLAGS")
    # shellcheck disable=SC2086
    setsid "$PY" train/run.py --model "$name" --data rs-fashion --train-size "$TRAIN_SIZE" \
        --epochs "$FT_EPOCHS" --lr "$FT_LR" "${init[@]}" --train-resampling "${TRAIN_PIPES[@]}" \
        --test-resampling pillow --device "$DEVICE" --data-root "$DATA_ROOT" --workers 4 \
        "${extra[@]}" $run_flags --out "$WORK/robust/$name" >"$WORK/logs/robust-$name.log" 2>&1 &
    pids+=($!)
done
if [[ "$DEVICE" == cuda ]]; then
    timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py >"$WORK/logs/test_cuda.log" 2>&1 &
fi
stopped=0
while :; do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    (( alive )) || break
    sleep 10
    collect
    if (( SECONDS > DEADLINE && ! stopped )); then
        log "deadline: Ctrl-C to every run still going (each saves last.pt)"
        for pid in "${pids[@]}"; do kill -INT -- "-$pid" 2>/dev/null; done
        stopped=1
    fi
done
wait
for name in rst_cnn_fb cnn; do
    log "robust $name: $(grep -o '"test[a-z_]*_acc": [0-9.]*' "$WORK/robust/$name/summary.json" 2>/dev/null | tr '\n' ' ')"
    log "protocol $name: $(grep -h -o '"test_acc": [0-9.]*' "$WORK"/reproduce/rs-fashion/*/"$name"-*/summary.json 2>/dev/null)"
done
log "$(tail -1 "$WORK/logs/test_cuda.log" 2>/dev/null)"
log "done"
collect
