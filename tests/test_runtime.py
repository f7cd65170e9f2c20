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
def test_without_jemalloc_the_default_asks_glibc_for_huge_pages_once(tmp_path):
    missing = str(tmp_path / "nope.so")
    assert run({"RSTCNN_JEMALLOC": missing, "LD_PRELOAD": ""}) == HUGEPAGE_TUNABLES
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
    for asked in ({"RSTCNN_ALLOCATOR": "jemalloc"}, {}):  # asked for, and every CLI's default
        preload, conf = run_jemalloc(asked).stdout.strip().split("|")
        assert preload == lib and conf == JEMALLOC_CONF
    # a MALLOC_CONF of the user's is kept
    out = run_jemalloc({"RSTCNN_ALLOCATOR": "jemalloc", "MALLOC_CONF": "narenas:2"})
    assert out.stdout.strip() == f"{lib}|narenas:2"
    # jemalloc preloaded by the user: kept, with the retaining settings unless it has its own
    assert run_jemalloc({"LD_PRELOAD": lib}).stdout.strip() == f"{lib}|{JEMALLOC_CONF}"
    out = run_jemalloc({"LD_PRELOAD": lib, "MALLOC_CONF": "narenas:2"})
    assert out.stdout.strip() == f"{lib}|narenas:2"


@pytest.mark.skipif(platform.system() != "Linux", reason="LD_PRELOAD is Linux-only")
def test_missing_jemalloc_warns_and_runs_on(tmp_path):
    out = run_jemalloc(
        {"RSTCNN_ALLOCATOR": "jemalloc", "RSTCNN_JEMALLOC": str(tmp_path / "nope.so")}
    )
    assert out.stdout.strip() == "|"
    assert "apt-get install libjemalloc2" in out.stderr


SERVER_CODE = (
    "from rstcnn.train.runtime import use_retaining_allocator; "
    "use_retaining_allocator(default='jemalloc'); import os; "
    "print(os.environ.get('LD_PRELOAD', '') + '|' + os.environ.get('GLIBC_TUNABLES', ''))"
)


@pytest.mark.skipif(platform.system() != "Linux", reason="LD_PRELOAD is Linux-only")
def test_a_jemalloc_default_preloads_it_or_falls_back_to_huge_pages(tmp_path):
    """The default (the web app's, with its own jemalloc settings, and every CLI's):
    jemalloc where the loader finds it; without it, silently, the huge-page tunable; an
    explicit RSTCNN_ALLOCATOR still wins."""
    from rstcnn.train.runtime import find_jemalloc

    def server(env_extra: dict) -> tuple[str, str]:
        drop = (
            "LD_PRELOAD",
            "MALLOC_CONF",
            "RSTCNN_ALLOCATOR",
            "RSTCNN_JEMALLOC",
            "GLIBC_TUNABLES",
        )
        env = {k: v for k, v in os.environ.items() if k not in drop}
        env.update(env_extra)
        out = subprocess.run(
            [sys.executable, "-c", SERVER_CODE], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        assert "WARNING" not in out.stderr
        return tuple(out.stdout.strip().split("|"))

    lib = find_jemalloc()
    assert lib is not None, "libjemalloc2 missing: run scripts/setup.sh as root"
    assert server({}) == (lib, "")
    missing = {"RSTCNN_JEMALLOC": str(tmp_path / "nope.so")}
    if platform.libc_ver()[0] == "glibc":
        assert server(missing) == ("", HUGEPAGE_TUNABLES)
        assert server({"RSTCNN_ALLOCATOR": "hugepages"}) == ("", HUGEPAGE_TUNABLES)
    assert server({"RSTCNN_ALLOCATOR": "system"}) == ("", "")


RELEASE_CODE = """
import numpy as np
from rstcnn.serve.memory import release_free_memory
def rss():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS'))
block = np.ones(256 << 20, dtype=np.uint8)  # 256 MiB, touched
del block
before = rss()
released = release_free_memory()
print(released, before - rss())
"""


@pytest.mark.skipif(platform.system() != "Linux", reason="LD_PRELOAD and /proc are Linux-only")
def test_release_free_memory_purges_what_a_retaining_jemalloc_keeps():
    from rstcnn.train.runtime import JEMALLOC_CONF, find_jemalloc

    lib = find_jemalloc()
    assert lib is not None, "libjemalloc2 missing: run scripts/setup.sh as root"
    drop = ("LD_PRELOAD", "MALLOC_CONF", "RSTCNN_ALLOCATOR", "GLIBC_TUNABLES")
    base = {k: v for k, v in os.environ.items() if k not in drop}
    kept = {**base, "LD_PRELOAD": lib, "MALLOC_CONF": JEMALLOC_CONF}
    for env, expect_release in ((kept, True), (base, False)):
        out = subprocess.run(
            [sys.executable, "-c", RELEASE_CODE], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        released, dropped_kib = out.stdout.split()
        assert released == str(expect_release)
        if expect_release:  # the 256 MiB jemalloc kept after the free went back
            assert int(dropped_kib) > 200 * 1024


@glibc_only
@pytest.mark.parametrize(
    "script, heavy",
    [
        ("train/run.py", "torch"),
        ("train/reproduce.py", "torch"),
        ("export/to_onnx.py", "torch"),
        ("serve/app.py", "gradio"),
    ],
)
def test_a_command_re_executes_before_its_heavy_imports(script, heavy):
    """A command run as a script (as ``rstcnn.cli``'s console commands do) re-executes with
    the retaining heap before its heavy imports: -X importtime, which the re-exec keeps,
    logs the launcher's imports in both processes and torch's (the app: gradio's; it
    imports no torch) in the second only."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "RSTCNN_ALLOCATOR")}
    env["RSTCNN_ALLOCATOR"] = "hugepages"
    out = subprocess.run(
        [sys.executable, "-X", "importtime", script, "--help"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]
    imported = [line.split("|")[-1].strip() for line in out.stderr.splitlines()]
    assert imported.count("rstcnn.cli") == 2  # the first process, then the re-executed one
    assert imported.count(heavy) == 1
