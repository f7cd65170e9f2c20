#!/usr/bin/env bash
# Main job. Installs what it needs into .venv first (via setup.sh); safe to run twice.
#
# TODO (later issues): this script will prepare the dataset, make sure a trained
# checkpoint exists, and start the web demo (serve/). For now it only prints the
# table of registered models.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

bash "$REPO_ROOT/scripts/setup.sh"

exec .venv/bin/python -m rstmodel.summary "$@"
