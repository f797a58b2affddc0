"""Sharded programs on 8 host devices keep their shardings through hlofold.fold.

The checks live in tests/_sharding_script.py and run in a subprocess: the host platform's
device count (XLA_FLAGS=--xla_force_host_platform_device_count=8) must be set before JAX
initializes, and this pytest process already runs JAX on 1 CPU device.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def run_script(*checks: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=8").strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "tests.front._sharding_script", *checks], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)


# the checks in three processes, so that test workers share them out
GROUPS = (("resnet-data-auto", "resnet-model-auto", "constrained-data-auto"),
          ("constrained-model-auto", "resnet-data-explicit", "shard-map-explicit"),
          ("shard-map-auto",))


def test_the_groups_cover_every_check():
    from tests.front._sharding_script import CHECKS
    assert sorted(sum(GROUPS, ())) == sorted(CHECKS)


@pytest.mark.parametrize("checks", [GROUPS[0]] + [pytest.param(g, marks=pytest.mark.slow)
                                                 for g in GROUPS[1:]],
                         ids=["auto", "explicit", "shard-map"])
def test_sharded_programs_keep_their_shardings(checks):
    """ResNet-10 and a conv+BN net with with_sharding_constraint, data-parallel and with
    kernels sharded over output channels (Auto mesh axes), plus data-parallel on an Explicit
    mesh: every BN folds, in/out shardings and constraints are kept, results match, and the
    compiled folded program (and its apply part) has no more all-gathers than the original;
    and fold inside shard_map."""
    proc = run_script(*checks)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for name in checks:
        assert f"ok {name}:" in proc.stdout, out[-6000:]


def test_script_fails_loudly():
    """A failing check exits non-zero (the script is not silently green)."""
    proc = run_script("nope-data-auto")
    assert proc.returncode != 0 and "unknown check" in proc.stderr
