"""The CLIs' opt-in allocator set-up re-executes the process once with glibc's tunables."""

import os
import platform
import subprocess
import sys

import pytest

from rstmodel.runtime import RETAINING_TUNABLES

CODE = (
    "from rstmodel.runtime import use_retaining_allocator; use_retaining_allocator(); "
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


def test_default_leaves_the_environment_alone():
    assert run({}) == ""
