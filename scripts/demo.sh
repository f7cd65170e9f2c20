#!/usr/bin/env bash
# Main job: installs what it needs (scripts/setup.sh), prepares the default data set
# (RS-Fashion, realisation 0: what a float32 export made here is checked on; cached, so a second run
# is quick), serves the shipped checkpoints in models/ side by side (from their committed,
# checked int8 ONNX files, or from a float32 export made here; the RST-CNN's checkpoint also
# competes, run by eager torch, where the app measures it faster) in the web app on
# http://127.0.0.1:7860 (Ctrl-C stops it). Extra arguments go to serve/app.py
# (e.g. --port 8000).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

bash "$REPO_ROOT/scripts/setup.sh"

.venv/bin/python train/prepare_data.py --data rs-fashion --realisations 0

# Each model is served from its committed int8 file (models/NAME.int8.onnx: faster on this
# CPU, accuracy check passed and recorded in the file) while that file was exported from the
# checkpoint beside it; otherwise from a float32 export, made here when missing or stale.
served=()
for name in rst_cnn_fb cnn; do
    if .venv/bin/python -m export.precision current "models/$name.int8.onnx" "models/$name.pt"; then
        served+=(--model "models/$name.int8.onnx")
        continue
    fi
    if [[ ! -f "models/$name.onnx" || "models/$name.pt" -nt "models/$name.onnx" ]]; then
        .venv/bin/python export/to_onnx.py "models/$name.pt" -o "models/$name.onnx" --check 256
    fi
    served+=(--model "models/$name.onnx")
done

# The RST-CNN's checkpoint competes too, run by eager torch (serve.eager): with int8
# per-frequency products, else in bfloat16, else with int16 products (CPUs with AVX2 but no
# AVX-512), where this CPU has them and the recorded accuracy check at that precision
# (models/rst_cnn_fb.int8-gate.json, .bf16-gate.json, .int16-gate.json, made by
# train/precision_check.py --precision P --record) passes, float32 otherwise. The app measures each copy at
# one image and at a sweep's batch and serves the fastest for each (serve.variants).
served+=(--model models/rst_cnn_fb.pt)

exec .venv/bin/python serve/app.py "${served[@]}" "$@"
