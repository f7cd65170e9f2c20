#!/usr/bin/env bash
# Main job: installs what it needs (scripts/setup.sh), prepares the default data set
# (RS-Fashion, realisation 0; cached, so a second run is quick) and prints the models.
# The web demo on a shipped model takes this script's place once serve/ exists.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

bash "$REPO_ROOT/scripts/setup.sh"

.venv/bin/python train/prepare_data.py --data rs-fashion --realizations 0
exec .venv/bin/python -m rstmodel.summary
