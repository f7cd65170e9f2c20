#!/usr/bin/env bash
# What a lent GPU machine is for, as one prepared command per call (each call may run at
# most 10 minutes; results go to $OUT, which comes back even when a call times out):
#
#   bash scripts/gpu_session.sh train    # full-width rst_cnn_fb + cnn, paper recipe, RS-Fashion
#   bash scripts/gpu_session.sh checks   # the tests that skip without CUDA / TensorRT / ort-gpu
#
# The machine has no apt and no internet: carry the Fashion-MNIST IDX files in .gpu_data/
# (mkdir -p .gpu_data && cp /usr/share/datasets/fashion-mnist/*.gz .gpu_data/), and a run
# folder to resume (carry runs/gpu). Python: $PY, else the machine's torch environment.
set -uo pipefail

STAGE="${1:-train}"
OUT="${OUT:-$PWD/runs/gpu-out}"
PY="${PY:-}"
if [[ -z "$PY" ]]; then
    for cand in /opt/torch/.venv/bin/python python3; do
        if command -v "$cand" >/dev/null 2>&1; then PY="$cand"; break; fi
    done
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
log() { echo "[gpu $(date +%H:%M:%S)] $*" | tee -a "$OUT/session.log"; }

log "stage $STAGE, python $PY"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT/session.log"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1 \
    | tee -a "$OUT/session.log"

# RS-Fashion realisation 0 from the carried IDX files (7 s)
export RSTCNN_DATA="$OUT/data"
"$PY" train/prepare_data.py --data rs-fashion --realizations 0 --data-root .gpu_data \
    --cache "$RSTCNN_DATA" 2>&1 | tail -3 | tee -a "$OUT/session.log"

case "$STAGE" in
train)
    # ~8 minutes on an H200 (7.8 s per epoch of 5,000 images with augmentation); resumable:
    # a call that times out leaves last.pt in $OUT, and the next call continues it
    for model in rst_cnn_fb cnn; do
        dir="$OUT/$model"
        resume=()
        [[ -f "$dir/last.pt" ]] && resume=(--resume)
        log "training $model -> $dir"
        "$PY" train/run.py --model "$model" --data rs-fashion --train-size 5000 --augment \
            --data-root .gpu_data --device cuda --out "$dir" "${resume[@]}" > "$OUT/$model.log" 2>&1
        log "$model exit $?: $(grep -o '"test_acc": [0-9.]*' "$dir/summary.json" 2>/dev/null)"
    done
    ;;
checks)
    "$PY" -c 'import onnxruntime as ort; print("onnxruntime", ort.__version__, ort.get_available_providers())' \
        2>&1 | tee -a "$OUT/session.log"
    "$PY" -c 'import tensorrt as trt; print("tensorrt", trt.__version__)' 2>&1 | tee -a "$OUT/session.log"
    "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_export.py \
        tests/test_classifier.py -k "cuda or tensorrt or gpu or provider" 2>&1 \
        | tail -15 | tee -a "$OUT/session.log"
    # one-GPU nccl smoke run of the DDP path (2 GPUs needed for more than a smoke test)
    "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 train/run.py --model cnn \
        --data rs-fashion --data-root .gpu_data --train-size 512 --epochs 1 --device cuda --out "$OUT/ddp-nccl" \
        > "$OUT/ddp-nccl.log" 2>&1
    log "nccl DDP smoke exit $?"
    ;;
*)
    echo "usage: bash scripts/gpu_session.sh {train|checks}" >&2
    exit 2
    ;;
esac
log "done"
