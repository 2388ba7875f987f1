"""Shared fixtures: ``cli_procs`` runs the command line in real processes (to kill, interrupt or limit them).

A process that imported fp4convert (and torch, ~6 s) once forks a child per run, so a test can
SIGKILL or SIGINT a real run many times in a few seconds. The fork happens before any torch work,
so no thread pool is inherited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ZYGOTE = r"""
import json, os, resource, signal, sys, time
import fp4convert.cli
import fp4convert.run.convert, fp4convert.checkpoint.export, fp4convert.checkpoint.inspect  # torch and the work modules, before the forks
import transformers, transformers.conversion_mapping, transformers.core_model_loading  # the planner's model definitions
from fp4convert.cli.main import main
out = sys.stdout
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "wait":
        pid, deadline = req["pid"], time.monotonic() + req["timeout"]
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = "timeout"
                break
            time.sleep(0.005)
        out.write(json.dumps(code) + "\n"); out.flush()
        continue
    pid = os.fork()
    if pid == 0:
        code = 98
        try:
            os.environ.update(req.get("env", {}))
            if req.get("fsize"):
                resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1); os.dup2(fd, 2)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                main(req["args"], prog_name="fp4convert")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    out.write(json.dumps(pid) + "\n"); out.flush()
os._exit(0)  # stdin closed: no interpreter shutdown (torch + transformers take seconds to tear down under load)
"""


class CliProcs:
    """Start ``fp4convert ARGS`` in a child process; kill, interrupt or wait for it."""

    def __init__(self, tmp: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
        self.tmp = tmp
        self.n = 0
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True)

    def _ask(self, req: dict):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def start(self, *args, env: dict | None = None, fsize: int | None = None) -> tuple[int, Path]:
        self.n += 1
        log = self.tmp / f"run{self.n}.log"
        pid = self._ask({"op": "run", "args": [str(a) for a in args], "env": env or {}, "fsize": fsize,
                         "log": str(log)})
        return pid, log

    def wait(self, pid: int, timeout: float = 60) -> int | str:
        return self._ask({"op": "wait", "pid": pid, "timeout": timeout})

    def run(self, *args, timeout: float = 300, **kw) -> tuple[int | str, str]:
        """Run to the end. ``timeout`` only catches a hang: a first run builds the model definition in a
        child (a Python start and transformers' imports), which took over 60 s on a loaded 2-core machine."""
        pid, log = self.start(*args, **kw)
        code = self.wait(pid, timeout)
        return code, log.read_text()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session", autouse=True)
def _definition_cache(tmp_path_factory):
    """Model definitions cached per test session (fp4convert.plan.definition.cache_dir), not in the user's cache:
    the first plan of each model pays for transformers, later ones read the cache, as a user's runs do."""
    old = os.environ.get("FP4CONVERT_DEFINITION_CACHE")
    os.environ["FP4CONVERT_DEFINITION_CACHE"] = str(tmp_path_factory.mktemp("definitions"))
    yield
    if old is None:
        os.environ.pop("FP4CONVERT_DEFINITION_CACHE", None)
    else:
        os.environ["FP4CONVERT_DEFINITION_CACHE"] = old


@pytest.fixture(scope="session", autouse=True)
def _calibration_cache(tmp_path_factory):
    """Kept calibration results (fp4convert.calibrate.resume) per test session, not in the user's cache."""
    old = os.environ.get("FP4CONVERT_CALIBRATION_CACHE")
    os.environ["FP4CONVERT_CALIBRATION_CACHE"] = str(tmp_path_factory.mktemp("calibration"))
    yield
    if old is None:
        os.environ.pop("FP4CONVERT_CALIBRATION_CACHE", None)
    else:
        os.environ["FP4CONVERT_CALIBRATION_CACHE"] = old


@pytest.fixture(scope="session")
def cli_procs(tmp_path_factory):
    procs = CliProcs(tmp_path_factory.mktemp("procs"))
    yield procs
    procs.close()
