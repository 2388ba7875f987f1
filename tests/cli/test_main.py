"""The ``fp4convert`` program's entry point (fp4convert/cli/main.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# The entry point with a command that loads torch; libgomp prints the settings it read (OMP_DISPLAY_ENV): with
# no policy given it spins GOMP_SPINCOUNT = 300000 times at a barrier (and prints the policy as PASSIVE all
# the same), with PASSIVE 0 times, with ACTIVE without end.
PROBE = ("import fp4convert.cli.main as m; "
         "m.main = lambda **kw: __import__('torch').ones(1); m.entry()")


@pytest.mark.parametrize("given,policy,spins", [(None, "PASSIVE", "0"), ("ACTIVE", "ACTIVE", "30000000000")])
def test_torch_s_openmp_threads_sleep_unless_the_environment_says_otherwise(given, policy, spins):
    """torch's OpenMP runtime reads OMP_WAIT_POLICY once, when torch loads: the entry point sets it before
    any command runs; a policy the user set is kept."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    got = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    assert f"OMP_WAIT_POLICY = '{policy}'" in got.stderr, got.stderr[-3000:]
    assert f"GOMP_SPINCOUNT = '{spins}'" in got.stderr, got.stderr[-3000:]
