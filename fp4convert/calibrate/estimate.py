"""How long a calibration will take, said before the long work and kept honest (docs/numerics.md "GPTQ", "Cost").

Before anything runs (``--dry-run`` too) :func:`plan_lines` says what will happen: the samples, the blocks, the
matrices a method quantizes, and a rough time from the work's arithmetic (the forwards, the Hessians, the sweeps'
lazy updates) over this machine's measured matmul rate (:func:`probe_rate`, a fraction of a second). Once the run
has finished its first block, :class:`BlockClock` says the time the blocks will take from what that block took,
each later block weighed by its own arithmetic against the first's (a DeepSeek-V3's MoE blocks against its dense
ones), and says it again when the first block of another kind lands far from it. The progress line's time left
follows every block (:mod:`fp4convert.calibrate.progress`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from fp4convert.plan.types import QUANTIZE

if TYPE_CHECKING:
    from fp4convert.plan.calibration import CalibrationPlan
    from fp4convert.plan.planner import Plan

log = logging.getLogger(__name__)

RETELL = 1.25  # a new kind of block that moves the estimate by this factor or more is said again
PASSES = 4  # block runs of a method's pass: the observed run, the true-sequential steps' (about two), the rerun


def block_work(plan: Plan, tokens: int) -> dict[int, float]:
    """Block index -> its arithmetic (FLOPs) under a calibrated method on ``tokens`` calibration tokens: PASSES
    forwards of its quantized matrices (2 N K a token; a routed expert's by the share of tokens it gets), each
    input's Hessian (2 K^2 a token), and each matrix's sweep (its lazy update, 2 N K^2). Blocks are told apart by
    the ``.layers.<i>.`` part of their tensors' names (as the planner names them)."""
    import re

    experts: dict[int, int] = {}
    for d in plan.decisions:
        hit = re.search(r"\.layers\.(\d+)\..*\.experts\.(\d+)\.", d.name)
        if hit:
            experts[int(hit.group(1))] = max(experts.get(int(hit.group(1)), 0), int(hit.group(2)) + 1)
    work: dict[int, float] = {}
    for d in plan.decisions:
        if d.action != QUANTIZE:
            continue
        hit = re.search(r"\.layers\.(\d+)\.", d.name)
        if not hit:
            continue
        i = int(hit.group(1))
        share = 8 / experts[i] if i in experts and ".experts." in d.name else 1.0  # (top-8 of the experts, roughly)
        for m in d.matrices:
            n, k = m.shape
            work[i] = work.get(i, 0.0) + tokens * share * (PASSES * 2 * n * k + 2 * k * k) + 2 * n * k * k
    return work


def probe_rate(device) -> float:
    """This machine's fp32 matmul rate in FLOP/s on ``device`` (a few products of 1024 x 1024, timed)."""
    import torch

    dev = torch.device(device)
    a = torch.randn(1024, 1024, device=dev)
    b = torch.randn(1024, 1024, device=dev)
    a @ b
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(4):
        a @ b
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return 4 * 2 * 1024**3 / max(time.perf_counter() - t0, 1e-9)


def plan_lines(cal: CalibrationPlan, plan: Plan, device) -> list[str]:
    """What the calibration will do, in words, with a rough time from its arithmetic and the probed rate."""
    lines = cal.describe()
    if not cal.runs_model or cal.samples is None and cal.random is None:
        return lines
    tokens = (cal.samples or cal.random).tokens  # type: ignore[union-attr]
    work = block_work(plan, tokens)
    matrices = sum(len(d.matrices) for d in plan.decisions if d.action == QUANTIZE)
    lines.append(f"{len(work)} blocks, {matrices} quantized matrices, {tokens:,} calibration tokens a block")
    if cal.method is not None and work:
        rate = probe_rate(device)
        lines.append(f"rough time for the blocks: {duration(sum(work.values()) / rate)} (their arithmetic at this "
                     f"machine's {rate / 1e9:.0f} GFLOP/s; the run measures its first block and says again)")
    return lines


class BlockClock:
    """The blocks' time, from the blocks measured so far (see the module's docstring): :meth:`done` after each."""

    def __init__(self, work: dict[int, float], blocks: int, desc: str) -> None:
        self.work, self.blocks, self.desc = work, blocks, desc
        self.start()
        self.told: float | None = None  # the total said first
        self.actual = 0.0  # the blocks' time so far
        self.rates: list[float] = []  # seconds per FLOP of each kind of block measured
        self._kinds: set[float] = set()

    def start(self) -> None:
        """The blocks start now (the block runner calls it once the first block's inputs are captured)."""
        self.t0 = self._last = time.perf_counter()

    def done(self, i: int) -> None:
        """Block ``i`` finished: the estimate said after the first block, and again when a new kind moves it."""
        now = time.perf_counter()
        took, self._last = now - self._last, now
        self.actual = now - self.t0
        w = self.work.get(i, 0.0)
        if w <= 0:
            return
        kind = round(w, -3)
        new = kind not in self._kinds
        self._kinds.add(kind)
        if not new:
            return
        self.rates.append(took / w)
        per_flop = max(self.rates)  # (the slowest kind measured: an estimate that errs long)
        left = sum(v for j, v in self.work.items() if j > i) * per_flop
        total = now - self.t0 + left
        if self.told is None or not (1 / RETELL < total / self.told < RETELL):
            log.info("%s: block %d of %d took %s; the blocks should take about %s in all (%s more)", self.desc,
                        i + 1, self.blocks, duration(took), duration(total), duration(left))
            self.told = total


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
