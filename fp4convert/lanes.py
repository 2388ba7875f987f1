"""Lanes: one process's output shards split across threads, each lane reading, quantizing and writing its own.

On the GPU the converter is bound by the host: on the H200 machine the GPU and the reads took
10-15% of a dense conversion's time, the one writer thread the rest (page-cache writes at 1.4 GB/s
from one thread, 2.3 GB/s from four; the disk syncing 0.94 GB/s for one writer, 1.5 GB/s for
eight; sha256 at 1.2 GB/s per thread). Lanes write several shards side by side. Each lane is a
torchrun rank in miniature: the same deterministic split (:func:`~fp4convert.distributed.assign`),
its own progress record, the same merge and finish, so the bytes (and ``--resume`` after a kill)
are those of a one-lane run. A lane that fails stops the others at their next unit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .distributed import World, assign, describe, merge_and_finish, write_share
from .errors import RankStopped

if TYPE_CHECKING:
    from .plan import Decision, Plan

log = logging.getLogger(__name__)

AUTO_LANES = 2  # lanes of a torch-free CUDA run of a local folder when --lanes is not given

LaneFns = tuple  # (init, progress, process, start, drain), as fp4convert.convert._Lane gives them


def lane_shards(plan: Plan, lanes: int) -> list[set[str]]:
    """Each lane's output shards (disjoint, together every shard)."""
    return [assign(plan, World(k, lanes, k, lanes)) for k in range(lanes)]


def reporter(plan: Plan, shards: list[set[str]]) -> Callable[[list[Decision]], int]:
    """Which lane tells a unit's progress: the owner of its first output's shard (lane 0 for a unit
    without outputs), so a shared progress bar counts every unit once."""
    shard_of = plan.shard_of()
    owner = {f: k for k, fs in enumerate(shards) for f in fs}

    def of(unit: list[Decision]) -> int:
        for d in unit:
            for e in d.outputs:
                return owner.get(shard_of[e.name], 0)
        return 0

    return of


def run_lanes(plan: Plan, dst: Path, identity: dict, done: dict, lanes: list[LaneFns], nonfinite=None) -> list[dict]:
    """Every lane's ``write_outputs`` on its own thread; returns their statuses (files, tensors) for
    :func:`~fp4convert.distributed.merge_and_finish`, or raises the first lane's error (the first in
    time) once all stopped. DST's lock stays with the caller, whatever happens."""
    from .writer import nonfinite_warning

    shards = lane_shards(plan, len(lanes))
    told_by = reporter(plan, shards)
    stop = threading.Event()
    statuses: list[dict] = [{"lane": k} for k in range(len(lanes))]
    first: list[BaseException] = []  # the first lane error, in time
    lock = threading.Lock()

    def check() -> None:
        if stop.is_set():
            raise RankStopped()

    def run(k: int) -> None:
        init, progress, process, start, drain = lanes[k]
        try:
            if init is not None:
                init()  # a new thread: select this run's GPU before any allocation or launch
            statuses[k].update(write_share(plan, dst, identity, done, shards[k], k, check, progress, process, start,
                                           drain, nonfinite, reports=lambda u: told_by(u) == k, lane=k))
        except RankStopped:
            statuses[k]["stopped"] = True
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            with lock:
                first.append(exc)
            statuses[k]["error"] = describe(exc)
            stop.set()

    threads = [threading.Thread(target=run, args=(k,), name=f"fp4convert-lane{k}") for k in range(len(lanes))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:  # Ctrl-C in the main thread: the lanes stop at their next unit, then it goes on
        stop.set()
        for t in threads:
            t.join()
        raise
    if first:
        raise first[0]
    # Kept tensors found holding NaN/Inf, from every lane's records, in plan order.
    flagged = {n for st in statuses for n, rec in st["tensors"].items() if rec.get("nonfinite")}
    for n, d in plan.by_name.items():
        w = nonfinite_warning(n, d.info.file)
        if n in flagged and w not in plan.warnings:
            plan.warnings.append(w)
    return statuses


def write_with_lanes(plan: Plan, dst: Path, config, identity: dict, source, fmt, lanes: list[LaneFns],
                     nonfinite=None) -> dict:
    """One process's run over several lanes: the destination policy, the lanes, the finish (as
    :func:`~fp4convert.distributed.run_writes` is for one); returns what a resume reused."""
    from .writer import prepare_destination, release

    done = prepare_destination(dst, plan, config, identity, source)
    try:
        statuses = run_lanes(plan, dst, identity, done, lanes, nonfinite)
    except BaseException:
        release(dst)  # once, after every lane stopped (finished shards stay for --resume)
        raise
    merge_and_finish(statuses, source, plan, fmt, dst, identity)
    return done
