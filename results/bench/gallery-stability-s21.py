"""The app's stability sweeps on its 12 gallery images, eager float32, for the RST-CNN shipped
until the twenty-first session, the one shipped since, and the CNN.

    git show a03e290:models/rst_cnn_fb.pt > /tmp/old_rst.pt
    python results/bench/gallery-stability-s21.py
"""

import glob

import numpy as np

from rstcnn.serve import Classifier
from rstcnn.serve.stability import measure_stability

files = sorted(glob.glob("rstcnn/serve/gallery/*.png"))
for checkpoint in ["/tmp/old_rst.pt", "models/rst_cnn_fb.pt", "models/cnn.pt"]:
    clf = Classifier.from_checkpoint(checkpoint, precision="fp32")
    rows = [measure_stability([clf], f).to_dict()["models"][0] for f in files]
    print(checkpoint)
    for f, r in zip(files, rows, strict=True):
        agreement = {k: round(v["agreement"], 2) for k, v in r["sweeps"].items()}
        print(f"  {f.split('/')[-1]:22} {r['label']:12} {agreement}")
    means = {k: np.mean([r["sweeps"][k]["agreement"] for r in rows]) for k in rows[0]["sweeps"]}
    print("  mean agreement", {k: round(float(v), 3) for k, v in means.items()})
