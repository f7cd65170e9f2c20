"""The CLIs' allocator set-up re-executes the process once with glibc's tunables."""

import os
import platform
import subprocess
import sys

import pytest

from rstcnn.train.runtime import HUGEPAGE_TUNABLES, RETAINING_TUNABLES

CODE = (
    "from rstcnn.train.runtime import use_retaining_allocator; use_retaining_allocator(); "
    "import os; print(os.environ.get('GLIBC_TUNABLES', ''))"
)

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)


def run(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "RSTCNN_ALLOCATOR")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@glibc_only
def test_reexec_sets_the_tunables_once():
    assert run({"RSTCNN_ALLOCATOR": "retain"}) == RETAINING_TUNABLES


@glibc_only
def test_existing_tunables_are_kept():
    assert run({"RSTCNN_ALLOCATOR": "retain", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == (
        "glibc.malloc.arena_max=2:" + RETAINING_TUNABLES
    )


@glibc_only
def test_default_asks_glibc_for_huge_pages_once():
    assert run({}) == HUGEPAGE_TUNABLES
    assert run({"RSTCNN_ALLOCATOR": "hugepages"}) == HUGEPAGE_TUNABLES
    already = f"glibc.malloc.arena_max=2:{HUGEPAGE_TUNABLES}"
    assert run({"GLIBC_TUNABLES": already}) == already


def test_system_leaves_the_environment_alone():
    assert run({"RSTCNN_ALLOCATOR": "system"}) == ""


JEMALLOC_CODE = (
    "from rstcnn.train.runtime import use_retaining_allocator; use_retaining_allocator(); "
    "import os; print(os.environ.get('LD_PRELOAD', '') + '|' + os.environ.get('MALLOC_CONF', ''))"
)


def run_jemalloc(env_extra: dict) -> subprocess.CompletedProcess:
    drop = ("LD_PRELOAD", "MALLOC_CONF", "RSTCNN_ALLOCATOR", "RSTCNN_JEMALLOC")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-c", JEMALLOC_CODE], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out


@pytest.mark.skipif(platform.system() != "Linux", reason="LD_PRELOAD is Linux-only")
def test_jemalloc_is_preloaded_with_purging_off():
    # scripts/setup.sh installs libjemalloc2 (as root), so the loader finds it in CI
    from rstcnn.train.runtime import JEMALLOC_CONF, find_jemalloc

    lib = find_jemalloc()
    assert lib is not None, "libjemalloc2 missing: run scripts/setup.sh as root"
    preload, conf = run_jemalloc({"RSTCNN_ALLOCATOR": "jemalloc"}).stdout.strip().split("|")
    assert preload == lib and conf == JEMALLOC_CONF
    # a MALLOC_CONF of the user's is kept
    out = run_jemalloc({"RSTCNN_ALLOCATOR": "jemalloc", "MALLOC_CONF": "narenas:2"})
    assert out.stdout.strip() == f"{lib}|narenas:2"


@pytest.mark.skipif(platform.system() != "Linux", reason="LD_PRELOAD is Linux-only")
def test_missing_jemalloc_warns_and_runs_on(tmp_path):
    out = run_jemalloc(
        {"RSTCNN_ALLOCATOR": "jemalloc", "RSTCNN_JEMALLOC": str(tmp_path / "nope.so")}
    )
    assert out.stdout.strip() == "|"
    assert "apt-get install libjemalloc2" in out.stderr
