"""``/v1/classify`` with 8 clients, 200 requests each, for each named model of a running app
(the demo's three files): the CNN's rate is bound by what a request costs besides its model
(HTTP, decoding, preparing, answering), the RST-CNN's by its forward.

    python results/bench/classify-per-model-s27.py URL IMAGE MODEL...
"""

import sys
from pathlib import Path

from rstcnn.serve.loadtest import run_load

url, image = sys.argv[1], Path(sys.argv[2]).read_bytes()
for model in sys.argv[3:]:
    result = run_load(url, image, clients=8, requests=200, data={"model": model})
    print(f"{model}: " + result.report().replace("\n", "; "))
