#!/usr/bin/env bash
# Run lint + the test suite. Installs what it needs into .venv first (via setup.sh).
# Extra arguments are passed to pytest, e.g.: bash scripts/test.sh -m "not slow" -x
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

bash "$REPO_ROOT/scripts/setup.sh"

# Lint the Python code that exists so far.
LINT_PATHS=()
for d in rstmodel rstcnn tests; do
    if [[ -d "$d" ]]; then LINT_PATHS+=("$d"); fi
done
if (( ${#LINT_PATHS[@]} )); then
    echo "[test] ruff check ${LINT_PATHS[*]}"
    if ! .venv/bin/python -m ruff check "${LINT_PATHS[@]}"; then
        echo "[test] FAILED: ruff found lint errors (fix them, or try: .venv/bin/ruff check --fix)" >&2
        exit 1
    fi
fi

echo "[test] pytest tests $*"
set +e
.venv/bin/python -m pytest tests "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "[test] FAILED: pytest collected no tests (exit code 5)" >&2
    exit 1
fi
if [[ $rc -ne 0 ]]; then
    echo "[test] FAILED: pytest exit code $rc" >&2
else
    echo "[test] all checks passed"
fi
exit "$rc"
