#!/usr/bin/env bash
# Everything a lent GPU machine is for, as ONE prepared command (a session gets ~15 minutes
# of device time and one call may run at most 10): train the shipped models and run the
# checks that skip without CUDA, inside a deadline, results copied to $OUT as they appear.
#
#   bash scripts/gpu_session.sh            # on the GPU machine (the device tool's `run`)
#   DEVICE=cpu DEADLINE=120 TRAIN_SIZE=512 MODEL_ARGS="channels=(4,6,8)" LIMIT_TEST=256 \
#       DATA_ROOT=/usr/share/datasets/fashion-mnist bash scripts/gpu_session.sh
#                                          # a dry run of the same script on the CPU (tested)
#
# What runs, side by side on the one GPU:
#   * rst_cnn_fb on RS-Fashion (realisation 0, TRAIN_SIZE training images), the paper's
#     recipe (Adam, lr 0.01, tenfold decay at half time, batch 128) for as many epochs as
#     fit the deadline (at most MAX_EPOCHS): 8 timed training steps decide the count;
#   * cnn, same data and epochs (a small fraction of the GPU);
#   * tests/test_cuda.py and a one-GPU nccl torchrun smoke run of the DDP path.
# Comes back in $OUT (at most 8 files): rst_cnn_fb.pt, cnn.pt (best-validation
# checkpoints, test results written in), rst_cnn_fb.last.pt (to resume), results.tgz
# (metrics.jsonl, summary.json and logs of everything).
#
# The machine has no apt and no internet: carry the Fashion-MNIST IDX files in .gpu_data/
# (mkdir -p .gpu_data && cp /usr/share/datasets/fashion-mnist/*.gz .gpu_data/).
set -uo pipefail

DEVICE="${DEVICE:-cuda}"
DEADLINE="${DEADLINE:-540}"          # seconds from the start of this script
TRAIN_SIZE="${TRAIN_SIZE:-20000}"
MAX_EPOCHS="${MAX_EPOCHS:-60}"
MODEL_ARGS="${MODEL_ARGS:-}"
LIMIT_TEST="${LIMIT_TEST:-}"
DATA_ROOT="${DATA_ROOT:-.gpu_data}"  # the Fashion-MNIST IDX files
VAL_SIZE="${VAL_SIZE:-}"
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
mkdir -p "$OUT" "$WORK/logs"
LOG="$WORK/logs/session.log"
log() { echo "[gpu +$((SECONDS))s] $*" | tee -a "$LOG"; }

collect() {  # what has appeared so far -> $OUT (comes back even if the call is cut off)
    local name
    for name in rst_cnn_fb cnn; do
        [[ -f "$WORK/$name/best.pt" ]] && cp -f "$WORK/$name/best.pt" "$OUT/$name.pt.tmp" \
            && mv -f "$OUT/$name.pt.tmp" "$OUT/$name.pt"
    done
    [[ -f "$WORK/rst_cnn_fb/last.pt" ]] && cp -f "$WORK/rst_cnn_fb/last.pt" "$OUT/last.tmp" \
        && mv -f "$OUT/last.tmp" "$OUT/rst_cnn_fb.last.pt"
    (cd "$WORK" && tar czf "$OUT/results.tmp" logs $(ls -d */metrics.jsonl */summary.json \
        ddp-nccl/*.json 2>/dev/null)) && mv -f "$OUT/results.tmp" "$OUT/results.tgz"
}

extra=()
[[ -n "$MODEL_ARGS" ]] && extra+=(--model-arg "$MODEL_ARGS")
[[ -n "$LIMIT_TEST" ]] && extra+=(--limit-test "$LIMIT_TEST")
[[ -n "$VAL_SIZE" ]] && extra+=(--val-size "$VAL_SIZE")

log "python $PY, device $DEVICE, deadline ${DEADLINE}s, train size $TRAIN_SIZE"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1
"$PY" -c 'import torch, onnxruntime as ort; print("torch", torch.__version__, "cuda",
torch.cuda.is_available(), "| onnxruntime", ort.__version__, ort.get_available_providers())' \
    2>&1 | tee -a "$LOG"
"$PY" -c 'import tensorrt as trt; print("tensorrt", trt.__version__)' >>"$LOG" 2>&1 \
    || log "tensorrt: not installed on this machine"

"$PY" train/prepare_data.py --data rs-fashion --realizations 0 --data-root "$DATA_ROOT" \
    >"$WORK/logs/prepare.log" 2>&1 || { log "data preparation failed"; tail -5 "$WORK/logs/prepare.log"; }
log "data ready"

# the CUDA tests and the nccl smoke run, in the background
(
    timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py >"$WORK/logs/test_cuda.log" 2>&1
    echo "test_cuda exit $?" >>"$WORK/logs/test_cuda.log"
    if [[ "$DEVICE" == cuda ]]; then
        timeout 150 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 train/run.py --model cnn \
            --data rs-fashion --train-size 512 --epochs 1 --device cuda --limit-test 512 \
            --out "$WORK/ddp-nccl" >"$WORK/logs/ddp-nccl.log" 2>&1
        echo "nccl DDP smoke exit $?" >>"$WORK/logs/ddp-nccl.log"
    fi
) &
CHECKS=$!

# how many epochs fit: 8 training steps of rst_cnn_fb at batch 128 (the last 5 timed)
STEP=$("$PY" - "$DEVICE" "$MODEL_ARGS" <<'EOF' 2>>"$LOG"
import ast, sys, time
import torch
import torch.nn.functional as F
import rstmodel
from train.run import use_tf32
device = torch.device(sys.argv[1])
use_tf32(device, True)  # as train/run.py by default
kwargs = dict([(k, ast.literal_eval(v)) for k, v in [sys.argv[2].split("=", 1)]]) if sys.argv[2] else {}
model = rstmodel.create_model("rst_cnn_fb", **kwargs).to(device)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
x = torch.randn(128, 1, 56, 56, device=device)
y = torch.randint(0, 10, (128,), device=device)
for i in range(8):
    if i == 3:
        torch.cuda.synchronize() if device.type == "cuda" else None
        began = time.perf_counter()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
torch.cuda.synchronize() if device.type == "cuda" else None
print(f"{(time.perf_counter() - began) / 5:.4f}")
EOF
)
# an epoch: its steps, plus validation (2,000 images) and loading, ~ +20 %; the test pass over
# the rest of the 70,000 images at ~0.4 of a training step per batch of 128
EPOCHS=$("$PY" -c "
import math
step, size, left = $STEP, $TRAIN_SIZE, $DEADLINE - $SECONDS
test = (70000 - size - 2000) / 128 * 0.4 * step + 30
epoch = math.ceil(size / 128) * step * 1.2 + 16 * 0.4 * step
print(max(2, min($MAX_EPOCHS, int((left - test) / epoch) // 2 * 2)))")
log "rst_cnn_fb train step ${STEP}s at batch 128 -> $EPOCHS epochs"

common=(--data rs-fashion --train-size "$TRAIN_SIZE" --epochs "$EPOCHS" --device "$DEVICE" "${extra[@]}")
"$PY" train/run.py --model cnn "${common[@]}" --out "$WORK/cnn" >"$WORK/logs/cnn.log" 2>&1 &
"$PY" train/run.py --model rst_cnn_fb "${common[@]}" --out "$WORK/rst_cnn_fb" \
    >"$WORK/logs/rst_cnn_fb.log" 2>&1 &
RST=$!
while kill -0 "$RST" 2>/dev/null; do
    sleep 15
    collect
    if (( SECONDS > DEADLINE + 30 )); then
        log "past the deadline: stopping rst_cnn_fb (Ctrl-C saves last.pt)"
        kill -INT "$RST"
    fi
done
wait "$RST"
log "rst_cnn_fb exit $?: $(grep -o '"test_acc": [0-9.]*' "$WORK/rst_cnn_fb/summary.json" 2>/dev/null)"
wait
log "cnn: $(grep -o '"test_acc": [0-9.]*' "$WORK/cnn/summary.json" 2>/dev/null)"
log "$(tail -1 "$WORK/logs/test_cuda.log" 2>/dev/null) | $(tail -1 "$WORK/logs/ddp-nccl.log" 2>/dev/null)"
collect
log "done"
collect
