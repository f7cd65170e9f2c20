#!/usr/bin/env bash
# Main job: installs what it needs (scripts/setup.sh), prepares the default data set
# (RS-Fashion, realisation 0: the app's gallery of real test images; cached, so a second run
# is quick), exports the shipped checkpoints in models/ to ONNX (again only when a checkpoint
# is newer than its .onnx) and serves them side by side in the web app on
# http://127.0.0.1:7860 (Ctrl-C stops it). Extra arguments go to serve/app.py
# (e.g. --port 8000).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

bash "$REPO_ROOT/scripts/setup.sh"

.venv/bin/python train/prepare_data.py --data rs-fashion --realizations 0

for name in rst_cnn_fb cnn; do
    if [[ ! -f "models/$name.onnx" || "models/$name.pt" -nt "models/$name.onnx" ]]; then
        .venv/bin/python export/to_onnx.py "models/$name.pt" -o "models/$name.onnx" --check 256
    fi
done

exec .venv/bin/python serve/app.py --model models/rst_cnn_fb.onnx --model models/cnn.onnx "$@"
