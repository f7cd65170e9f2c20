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

# One pytest process per core, up to 4 (RST_TEST_WORKERS overrides; 1: one process), each
# taking whole files (their module fixtures are built once) and torch threads of its share of
# the cores (tests/conftest.py). Much of the suite waits on subprocesses, servers and a
# browser, or runs small single-threaded ops: on 2 cores the suite takes ~11 min this way
# against ~20 in one process. A later "-n 0" among the arguments runs it in one process.
WORKERS="${RST_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}"
((WORKERS > 4)) && WORKERS=4
PARALLEL=()
((WORKERS > 1)) && PARALLEL=(-n "$WORKERS" --dist loadfile)
echo "[test] pytest tests ${PARALLEL[*]} $*"
set +e
.venv/bin/python -m pytest tests "${PARALLEL[@]}" "$@"
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
