"""Scale-out under torchrun: the plan's output shards split across ranks, rank 0 finishes.

``torchrun --nproc-per-node N [--nnodes M ...] -m fp4convert quantize SRC DST ...`` starts N x M
copies of the same command. Each plans the whole conversion from the headers (cheap, and the same
everywhere), takes its share of the output shards (:func:`assign`: deterministic, greedy by bytes)
and writes only those, on its own GPU (``LOCAL_RANK``) or on the CPU. Coordination is
``torch.distributed`` with gloo, initialised only when ``WORLD_SIZE > 1``:

- rank 0 prepares the destination (refuse / --overwrite / --resume checks) and tells the others
  what a resume may reuse; every rank records its finished shards in its own progress file;
- a failing rank marks the run failed in the rendezvous store, so the others stop at their next
  batch; every rank then exits non-zero, rank 0 naming the failing rank's one-line error;
- after every rank finished, rank 0 gathers all shard and tensor records, merges the progress
  files into one and writes the other files, the index and the manifest (last), as a single
  process does: the output is byte-identical to a single-process run.

A rank that dies without a word (killed, out of memory) makes torchrun stop the others; finished
shards stay recorded, so the same command with ``--resume`` (any number of ranks) continues.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import FP4ConvertError, RankFailed, RankStopped

if TYPE_CHECKING:
    from .plan import Plan

log = logging.getLogger(__name__)

FAILED_KEY = "fp4convert/failed"
TIMEOUT = datetime.timedelta(hours=24)  # a rank may wait this long for the slowest one


@dataclass(frozen=True)
class World:
    """This process's place in a torchrun job (rank 0 of 1 when not under torchrun)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @classmethod
    def from_env(cls) -> World:
        env = os.environ
        size = int(env.get("WORLD_SIZE", "1") or 1)
        if size <= 1:
            return cls()
        return cls(int(env.get("RANK", "0")), size, int(env.get("LOCAL_RANK", "0")),
                   int(env.get("LOCAL_WORLD_SIZE", str(size))))

    @property
    def distributed(self) -> bool:
        return self.size > 1

    # -- collectives (no-ops for one process) ---------------------------------------------------

    def init(self) -> None:
        """gloo process group from torchrun's environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE)."""
        if not self.distributed:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=TIMEOUT)
            atexit.register(self.close)  # gloo's threads must stop before the interpreter exits

    def close(self) -> None:
        if not self.distributed:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def gather(self, obj) -> list:
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def from_rank0(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on rank 0 only; every rank gets its result or raises its error."""
        if not self.distributed:
            return fn()
        import torch.distributed as dist

        box: list = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", fn())
            except Exception as exc:
                box[0] = ("error", describe(exc))
                dist.broadcast_object_list(box, src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise RankFailed(f"rank 0 failed: {value[0]}", value[1])
        return value

    # -- failure signal --------------------------------------------------------------------------

    def _store(self):
        try:
            from torch.distributed import distributed_c10d

            return distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store: the others learn at the final gather instead
            return None

    def mark_failed(self) -> None:
        store = self._store() if self.distributed else None
        if store is not None:
            try:
                store.set(FAILED_KEY, str(self.rank))
            except Exception:  # noqa: BLE001
                pass

    def check_failed(self) -> None:
        """Raise when another rank marked the run failed (so this one stops early)."""
        store = self._store() if self.distributed else None
        if store is None:
            return
        try:
            failed = store.check([FAILED_KEY])
        except Exception:  # noqa: BLE001
            return
        if failed:
            raise RankStopped()


def describe(exc: BaseException) -> tuple[str, int]:
    """(one-line message, exit code) of an error, as the CLI would print it."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, FP4ConvertError):
        return text, exc.exit_code
    return f"{type(exc).__name__}: {text}", 1


def assign(plan: Plan, world: World) -> set[str]:
    """The output shards this rank writes: greedy by cost, largest first, ties by order.

    A shard's cost is the bytes written to it plus an eighth of the bytes read for it: writes were
    the slow side (1.4 GB/s into the page cache from one thread, against 20 GB/s for reading the
    source into pinned memory on the H200 machine), so a shard of kept embeddings weighs what it
    costs. Deterministic from the plan alone, so every rank computes the same split without talking.
    """
    shards = [f for f, _ in plan.shards]
    if not world.distributed:
        return set(shards)
    cost = {f: 8 * sum(e.nbytes for e in entries) for f, entries in plan.shards}
    shard_of = plan.shard_of()
    for d in plan.decisions:
        if d.outputs:
            cost[shard_of[d.outputs[0].name]] += d.info.nbytes
    load = [0] * world.size
    mine: set[str] = set()
    for f in sorted(shards, key=lambda f: (-cost[f], shards.index(f))):
        r = min(range(world.size), key=lambda r: (load[r], r))
        load[r] += cost[f]
        if r == world.rank:
            mine.add(f)
    return mine


def run_writes(world: World, plan: Plan, dst: Path, config, identity: dict, source, fmt, progress,
               process, start=None, drain=None, nonfinite=None) -> dict:
    """Destination policy, this rank's shards, then (rank 0) the finish; returns the reused files.

    One process: exactly prepare_destination -> write_outputs -> finish.
    """
    from .writer import finish, prepare_destination, release, write_outputs

    done = world.from_rank0(lambda: prepare_destination(dst, plan, config, identity, source))
    if not world.distributed:
        write_outputs(plan, dst, identity, done, progress, process, start, drain=drain, nonfinite=nonfinite)
        drop_rank_records(dst)  # a resume after ranks or lanes: its own record holds what theirs did
        finish(source, plan, fmt, dst, identity)
        return done

    status: dict = {"rank": world.rank}
    error: Exception | None = None
    try:
        status.update(write_share(plan, dst, identity, done, assign(plan, world), world.rank, world.check_failed,
                                  progress, process, start, drain, nonfinite))
    except RankStopped:
        status["stopped"] = True
    except Exception as exc:
        error = exc
        status["error"] = describe(exc)
        world.mark_failed()
        log.error("rank %d failed: %s", world.rank, status["error"][0])
    statuses = world.gather(status)
    failed = [s for s in statuses if "error" in s]
    if failed:
        if world.rank == 0:
            release(dst)  # rank 0 holds the DST lock (taken in prepare_destination) until finish
        if error is not None:
            raise error
        first = failed[0]
        raise RankFailed(f"rank {first['rank']} failed: {first['error'][0]}", first["error"][1])

    world.from_rank0(lambda: merge_and_finish(statuses, source, plan, fmt, dst, identity))
    world.close()
    return done


def write_share(plan: Plan, dst: Path, identity: dict, done: dict, mine: set[str], k: int,
                check: Callable[[], None], progress, process, start, drain, nonfinite, **kw) -> dict:
    """One rank's (or lane's) part: its shards ``mine`` with its own progress record; ``check()``
    before each unit raises RankStopped once another part failed. Returns {files, tensors} to merge."""
    from .writer import rank_progress_name, write_outputs

    def checked(unit, writers):
        check()
        return process(unit, writers)

    files, tensors = write_outputs(plan, dst, identity, done, progress, checked, start, owns=mine.__contains__,
                                   progress_name=rank_progress_name(k), drain=drain, nonfinite=nonfinite, **kw)
    return {"files": {f: r for f, r in files.items() if f in mine}, "tensors": tensors}


def merge_and_finish(statuses: list[dict], source, plan: Plan, fmt, dst: Path, identity: dict) -> None:
    """Every rank's (or lane's) shard and tensor records into the one progress record, then the
    finish (the other files, the index, the manifest last): the bytes of a one-process run."""
    from .writer import PROGRESS_NAME, atomic_write, finish, merge_tensor_records, release

    state = {"identity": identity, "files": {}, "tensors": {}}
    for s in statuses:
        state["files"].update(s["files"])
        merge_tensor_records(state["tensors"], s["tensors"])
    try:
        atomic_write(dst / PROGRESS_NAME, json.dumps(state, indent=1, sort_keys=True))
        drop_rank_records(dst)
    except BaseException:
        release(dst)
        raise
    finish(source, plan, fmt, dst, identity)


def drop_rank_records(dst: Path) -> None:
    """Remove the per-rank (or per-lane) progress records once the one record holds their state."""
    from .writer import PROGRESS_NAME, progress_records

    for p in progress_records(dst):
        if p.name != PROGRESS_NAME:
            p.unlink()
