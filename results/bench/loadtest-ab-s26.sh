#!/usr/bin/env bash
# The app, servers in turn, each tree on its own library (PYTHONPATH=<tree>): the demo's
# three files (the RST-CNN's and the CNN's int8 ONNX files and the RST-CNN's checkpoint),
# 45 s after /healthz, then python -m serve.loadtest: /v1/classify with 8 clients (200
# requests) and one stability request at a time (5, a mirrored gallery image, so that the
# server sweeps it rather than answering from its gallery cache).
#   bash results/bench/loadtest-ab-s26.sh OLD_TREE NEW_TREE [ROUNDS]   (from /work/main)
set -euo pipefail
py=$PWD/.venv/bin/python
port=7872
image=$(mktemp --suffix=.png)
$py -c "from PIL import Image, ImageOps; ImageOps.mirror(Image.open('rstcnn/serve/gallery/sample_00_class0.png')).save('$image')"
for round in $(seq "${3:-1}"); do
  for tree in "$1" "$2"; do
    rev=$(git -C "$tree" rev-parse --short HEAD)
    log=$(mktemp)
    (cd "$tree" && PYTHONPATH="$tree" exec "$py" rstcnn/serve/app.py --model models/rst_cnn_fb.int8.onnx \
      --model models/cnn.int8.onnx --model models/rst_cnn_fb.pt --port $port) >"$log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$port/healthz" >/dev/null; do sleep 2; done
    sleep 45
    echo "== round $round: $tree ($rev), library $tree/rstcnn"
    grep -E "ms per image alone|per batch of" "$log" | grep rst_cnn_fb | sed 's/^.*INFO[^:]*: //' || true
    echo -n "stability: "
    (cd "$tree" && PYTHONPATH="$tree" "$py" -m serve.loadtest --url "http://127.0.0.1:$port" \
      --endpoint stability --clients 1 --requests 5 --image "$image") | grep "latency (valid)"
    echo -n "classify: "
    (cd "$tree" && PYTHONPATH="$tree" "$py" -m serve.loadtest --url "http://127.0.0.1:$port" \
      --clients 8 --requests 200 --image "$image") | grep -E "wall|latency \(valid\)" | paste -sd';'
    kill $pid; wait $pid 2>/dev/null || true
    rm -f "$log"
  done
done
rm -f "$image"
