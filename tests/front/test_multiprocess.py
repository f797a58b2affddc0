"""Two processes, one mesh (issue 29): ``hlofold`` on global arrays no process holds whole.
The checks run in ``tests/front/_multiprocess_script.py``, one process each (a
``jax.distributed`` job on this machine: CPU devices, gloo collectives)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow   # a long evidence run: CI runs it in the slow tier
def test_fold_freeze_and_fold_params_on_a_two_process_mesh():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]).rstrip(os.pathsep)}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.front._multiprocess_script",
                               str(i), str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    for rc, out, err in outs:
        assert rc == 0, (out + err)[-5000:]
        for check in ("ok fold:", "ok freeze", "ok fold_params:", "ok stack:",
                      "ok stack hlo"):
            assert check in out, (out + err)[-5000:]
