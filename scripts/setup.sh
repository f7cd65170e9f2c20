#!/usr/bin/env bash
# Idempotent bootstrap: creates .venv in the repo root and installs the project
# (editable, with the dev extra). Safe to run repeatedly: the pip install step is
# skipped unless pyproject.toml changed since the last successful install.
set -euo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

VENV="$REPO_ROOT/.venv"
VPY="$VENV/bin/python"
STAMP="$VENV/.rstcnn-installed"

log() { echo "[setup] $*"; }

hash_file() {
    if command -v sha256sum >/dev/null 2>&1; then
        sha256sum "$1" | cut -d' ' -f1
    elif command -v shasum >/dev/null 2>&1; then
        shasum -a 256 "$1" | cut -d' ' -f1
    else
        "$VPY" -c 'import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest())' "$1"
    fi
}

# 1. Virtual environment
if [[ -x "$VPY" ]] && "$VPY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    log "using existing virtualenv $VENV ($("$VPY" --version 2>&1))"
else
    BASE_PY=""
    for cand in python3.11 python3; do
        if command -v "$cand" >/dev/null 2>&1 \
            && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
            BASE_PY="$cand"
            break
        fi
    done
    if [[ -z "$BASE_PY" ]]; then
        echo "[setup] ERROR: need python3 >= 3.10 (python3.11 preferred) on PATH" >&2
        exit 1
    fi
    if [[ -e "$VENV" ]]; then
        log "existing $VENV is missing or has a broken/too-old python; recreating it"
        "$BASE_PY" -m venv --clear "$VENV"
    else
        log "creating virtualenv $VENV with $BASE_PY ($("$BASE_PY" --version 2>&1))"
        "$BASE_PY" -m venv "$VENV"
    fi
    rm -f "$STAMP"
fi

# 2. Project install (only when pyproject.toml changed)
WANT="$(hash_file pyproject.toml)"
HAVE="$(cat "$STAMP" 2>/dev/null || true)"
if [[ "$WANT" == "$HAVE" ]]; then
    log "dependencies up to date (pyproject.toml unchanged); skipping pip install"
else
    log "installing rstcnn (editable) with dev extras; the first run downloads/installs torch and can take several minutes..."
    "$VPY" -m pip install -e '.[dev]'
    echo "$WANT" > "$STAMP"
    log "install complete"
fi
log "ready: $VENV"
