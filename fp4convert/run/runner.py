"""The run loop: the one place that walks a plan's units, for a conversion and an export alike.

A run is cut into *parts*: torchrun ranks x lanes (threads of one process), one process being 1 x 1.
Each part writes its share of the output shards (:func:`~fp4convert.run.distributed.assign`: deterministic
from the plan, so every rank computes the same split without talking) and keeps its own progress
record. The loop calls down, never up (nothing below it is handed a function to call back):

1. the destination is prepared once (rank 0: refuse / ``--overwrite`` / ``--resume``, the lock);
2. every part walks the plan's units in order: a unit a resume finished is only counted; for any
   other, its :class:`~fp4convert.run.work.Work` (a reader and a backend for a conversion) gives the
   unit's records and its write job (a kept copy: its pieces), which the part's writer threads run
   side by side against the passive :class:`~fp4convert.output.shards.ShardSet` (every byte goes to
   the offset the plan gave it, so the order they finish in never matters);
3. once a unit's writes (and every write before them) are done, the loop tells the run's progress
   display (:mod:`fp4convert.run.progress`) the unit's input bytes and, with ``--delete-source-shards``,
   lets go of the Hub source shards no later unit reads (:class:`~fp4convert.source.release.ShardReleaser`);
4. a part that fails stops the others at their next unit (lanes: an event; ranks: the rendezvous
   store) and the run raises the first error once all stopped; finished shards stay for ``--resume``;
5. once every part is done, the parts' records are merged into one and the finish writes the other
   files, the index and the manifest (rank 0): the bytes of a one-part run, whatever the parts.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.errors import FP4ConvertError, RankFailed, RankStopped
from fp4convert.output.files import os_error, step
from fp4convert.output.record import PartRecord, drop_part_records, merge_tensor_records, nonfinite_warning, save_progress
from fp4convert.run.distributed import World, assign, describe
from fp4convert.run.writebehind import WriteBehind
from fp4convert.storage.names import PROGRESS_NAME, part_record

if TYPE_CHECKING:
    from fp4convert.config import ConvertConfig
    from fp4convert.formats.base import OutputFormat
    from fp4convert.output.destination import Session
    from fp4convert.plan.planner import Plan
    from fp4convert.plan.types import Decision
    from fp4convert.run.progress import Bar
    from fp4convert.run.work import Work
    from fp4convert.source.release import ShardReleaser
    from fp4convert.source.source import Source

log = logging.getLogger(__name__)


@dataclass
class ConvertResult:
    """What a run did; the CLI prints it, ``--json`` emits :meth:`to_json`."""

    dst: Path
    plan: Plan
    wall_s: float
    peak_rss_bytes: int
    reused_files: list[str] = field(default_factory=list)
    read_wait_s: float = 0.0  # time the work loop waited for source reads (0: reading fully hidden)
    stages_s: dict[str, float] = field(default_factory=dict)  # busy seconds per stage (fp4convert.timing)
    counts: dict[str, float] = field(default_factory=dict)  # other quantities (pinned MB allocated)

    def to_json(self) -> dict:
        return {
            "dst": str(self.dst),
            **self.plan.summary(),
            "reused_files": self.reused_files,
            "warnings": list(self.plan.warnings),
            "wall_s": round(self.wall_s, 3),
            "read_wait_s": round(self.read_wait_s, 3),
            "peak_rss_bytes": self.peak_rss_bytes,
            "stages_s": self.stages_s,
            "counts": self.counts,
        }


@dataclass(frozen=True)
class Job:
    """What a run writes, and from what: everything the loop needs, decided before it starts."""

    source: Source
    plan: Plan
    fmt: OutputFormat
    dst: Path
    config: ConvertConfig
    identity: dict
    others: list[Path]  # the source's other files the finish copies (the one walk of the source folder)
    release: ShardReleaser | None = None  # --delete-source-shards: the Hub shards to let go of after their last unit
    calibration: dict | None = None  # W4A4 NVFP4: how the activation scales were calibrated (the manifest records it)
    method: dict | None = None  # a calibrated method (--method): what the manifest says of its pass


@dataclass(frozen=True)
class Part:
    """One part of a run: its index among all parts, the shards it writes and its progress record."""

    index: int
    shards: frozenset[str]
    record: str


def parts_of(plan: Plan, world: World, lanes: int) -> list[Part]:
    """This process's parts (its lanes), out of ``world.size x lanes`` (disjoint, together every shard)."""
    total = world.size * lanes
    if total == 1:
        return [Part(0, frozenset(f for f, _ in plan.shards), PROGRESS_NAME)]
    out = []
    for lane in range(lanes):
        k = world.rank * lanes + lane
        out.append(Part(k, frozenset(assign(plan, World(k, total, k, total))), part_record(k)))
    return out


def teller(plan: Plan, parts: list[Part]) -> Callable[[list[Decision]], int]:
    """Which of this process's parts tells a unit's progress: the owner of its first output's shard,
    else the first part, so a shared progress bar counts every unit once."""
    shard_of = plan.shard_of()
    owner = {f: k for k, p in enumerate(parts) for f in p.shards}

    def of(unit: list[Decision]) -> int:
        for d in unit:
            for e in d.outputs:
                return owner.get(shard_of[e.name], 0)
        return 0

    return of


def plan_warnings(plan: Plan) -> list[str]:
    """The plan's warnings and every --ignore/--only pattern that matches no tensor (a typo, usually)."""
    from fp4convert.plan.planner import matches

    out = list(plan.warnings)
    for flag, patterns in (("--ignore", plan.config.ignore), ("--only", plan.config.only)):
        for p in patterns:
            if not any(matches(p, d.name) for d in plan.decisions):
                out.append(f"{flag} {p} matches no tensor")
    return out


def run(job: Job, world: World, works: list[Work], bar: Bar | None = None) -> dict:
    """Write ``job`` with one part per work (this process's lanes) under ``world``; returns what a
    resume reused (``{shard: record}``). ``bar``: the run's progress display, told each unit's input
    bytes once its writes are done. Under torchrun every rank calls this with the same job."""
    from fp4convert.output.destination import prepare_destination

    for w in plan_warnings(job.plan) if world.rank == 0 else []:
        log.warning("warning: %s", w)
    parts = parts_of(job.plan, world, len(works))
    if job.release is not None and (len(parts) > 1 or world.distributed):
        raise AssertionError("internal: source shards are deleted by a run of one part")  # convert() gives it one
    session: Session | None = None

    def prepare() -> dict:
        nonlocal session
        session, done = prepare_destination(job.dst, job.plan, job.config, job.identity, job.source, job.others)
        return done

    done: dict = world.from_rank0(prepare)  # type: ignore[assignment]
    try:
        states, error = _run_parts(job, world, parts, works, done, UnitsDone(bar, job.release))
        if world.distributed:
            states = _gather(world, states, error)
        elif error is not None:
            raise error
    except BaseException:
        if session is not None:
            session.fail()  # once, after every part stopped (finished shards stay for --resume)
        raise
    flagged = {n for st in states for n, rec in st["tensors"].items() if rec.get("nonfinite")}
    for n, d in job.plan.by_name.items():  # kept tensors found holding NaN/Inf, in plan order
        w = nonfinite_warning(n, d.info.file)
        if n in flagged and w not in job.plan.warnings:
            job.plan.warnings.append(w)
    world.from_rank0(lambda: _merge_and_finish(job, states, session))
    world.close()
    return done


class UnitsDone:
    """What the loop does once a unit's writes, and every write before them, are done (a light job on
    the part's writer threads, in plan order): the progress display gets the unit's input bytes, and
    the Hub shards whose last reader it was leave the cache (``--delete-source-shards``)."""

    def __init__(self, bar: Bar | None, release: ShardReleaser | None) -> None:
        self.bar, self.release = bar, release
        self._lock = threading.Lock()  # the lanes' writer threads report side by side

    def __call__(self, index: int, unit: list[Decision]) -> None:
        n = sum(d.info.nbytes for d in unit)
        with self._lock:
            if self.bar is not None:
                self.bar.update(n)
            if self.release is not None:
                self.release.unit_done(index)


def _run_parts(job: Job, world: World, parts: list[Part], works: list[Work], done: dict,
               report: UnitsDone) -> tuple[list[dict], BaseException | None]:
    """Every local part (one inline, several on threads); their states, and the first error in time."""
    stop = threading.Event()
    tells = teller(job.plan, parts)
    states: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def check() -> None:
        if stop.is_set():
            raise RankStopped()
        world.check_failed()

    def one(k: int) -> None:
        try:
            state = _run_part(job, parts[k], works[k], done, report, lambda u: tells(u) == k, check)
            with lock:
                states.append(state)
        except RankStopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller, in its thread
            with lock:
                errors.append(exc)
            stop.set()

    if len(parts) == 1:
        try:
            one(0)
        finally:
            works[0].close()
    else:
        threads = [threading.Thread(target=one, args=(k,), name=f"fp4convert-lane{k}") for k in range(len(parts))]
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
        finally:
            for w in works:
                w.close()
    return states, errors[0] if errors else None


def _gather(world: World, states: list[dict], error: BaseException | None) -> list[dict]:
    """Under torchrun: every rank's states, once all stopped; a failed rank fails every rank."""
    status: dict = {"rank": world.rank, "states": states}
    if error is not None:
        status["error"] = describe(error)
        world.mark_failed()
        log.error("rank %d failed: %s", world.rank, status["error"][0])
    statuses = world.gather(status)
    failed = [s for s in statuses if "error" in s]
    if failed:
        if error is not None:
            raise error
        first = failed[0]
        raise RankFailed(f"rank {first['rank']} failed: {first['error'][0]}", first["error"][1])
    return [st for s in statuses for st in s["states"]]


def _run_part(job: Job, part: Part, work: Work, done: dict, report: UnitsDone,
              tells: Callable[[list[Decision]], bool], check: Callable[[], None]) -> dict:
    """One part: every unit in plan order, its writes on the part's writer threads; returns its record."""
    from fp4convert.output.shards import ShardSet

    plan = job.plan
    work.thread_init()  # a lane's own thread: select the run's GPU before any allocation or launch
    record = PartRecord(job.dst, job.identity, done, part.record)
    shards = ShardSet(job.dst, plan, record.files, record.shard_done, part.shards.__contains__, work.nonfinite,
                      record.found_nonfinite)
    shard_of = shards.shard_of
    behind = WriteBehind(init=work.thread_init)

    def finished(unit: list[Decision]) -> bool:
        outputs = [e.name for d in unit for e in d.outputs]
        mine = [d for d in unit if any(shard_of[e.name] in part.shards for e in d.outputs)]
        return all(shards.skip(n) for n in outputs) and all(d.name in record.tensors for d in mine)

    try:
        record.save()  # a record exists before any shard does
        units = plan.units()
        pending = [u for u in units if not finished(u)]
        work.start(pending)
        pending_ids = {id(u) for u in pending}
        for index, unit in enumerate(units):
            if id(unit) in pending_ids:
                check()
                records, jobs = work.unit(unit)
                for job_ in jobs:  # a kept copy's pieces hold nothing until they run (held False)
                    behind.submit(functools.partial(work.write, job_, shards), held=job_.held)
                record.units_done(records)
            if tells(unit):
                # Once the unit's writes and every write before them are done: a Hub source shard it
                # lets go of (--delete-source-shards) has then been read for the last time.
                behind.submit(functools.partial(report, index, unit), light=True)
            if id(unit) in pending_ids:
                step()
        behind.drain(True)
        shards.finish()
        record.save()
        return {**record.state(), "record": part.record}
    except BaseException as exc:
        behind.drain(False)
        shards.abort()
        record.discard()
        if isinstance(exc, OSError) and not isinstance(exc, FP4ConvertError):
            raise os_error(exc, job.dst) from exc
        raise


def _merge_and_finish(job: Job, states: list[dict], session: Session | None) -> None:
    """Every part's shard and tensor records into the one progress record, then the finish (the other
    files, the index, the manifest last): the bytes of a one-part run."""
    from fp4convert.output.finish import finish

    try:
        if not (len(states) == 1 and states[0]["record"] == PROGRESS_NAME):  # one part: its record is the one
            state: dict = {"identity": job.identity, "files": {}, "tensors": {}}
            pending: list[str] = []
            for s in states:
                state["files"].update(s["files"])
                merge_tensor_records(state["tensors"], s["tensors"])
                pending += [n for n in s.get("pending", []) if n not in pending]
            if pending:
                state["pending"] = pending
            save_progress(job.dst, state)
        drop_part_records(job.dst)  # a resume after parts: the one record holds what theirs did
    except BaseException:
        if session is not None:
            session.fail()
        raise
    finish(job.source, job.plan, job.fmt, job.dst, job.identity, job.others, session, job.calibration, job.method)
