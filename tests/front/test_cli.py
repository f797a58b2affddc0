"""The command line, driven through the real entry point in a subprocess."""
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore"}


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "hlofold", *args], capture_output=True,
                          text=True, timeout=timeout, env=ENV)


def test_demo_smoke():
    r = run("demo", "--depth", "10", "--width", "8", "--size", "32", "--batch", "2",
            "--rounds", "3")
    assert r.returncode == 0, r.stderr
    # 12 BN; the pooling's 1/(H·W) in front of the head is left by the cost rule
    assert "hlofold: 12 folded, 0 refused" in r.stdout and "1 left for cost" in r.stdout
    assert r.stdout.count("PASS") == 2 and "FAIL" not in r.stdout
    assert "stablehlo.convolution" in r.stdout
    assert "[5/5] timing" in r.stderr            # progress goes to stderr


@pytest.mark.parametrize("args", [(), ("demo", "--width", "0"), ("demo", "--depth", "7"),
                                  ("nonsense",)])
def test_bad_usage_exits_2(args):
    r = run(*args)
    assert r.returncode == 2
    assert r.stdout == ""
    assert "usage" in r.stderr.lower()
