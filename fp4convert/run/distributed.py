"""Scale-out under torchrun: this process's place in the job, the deterministic split, the collectives.

``torchrun --nproc-per-node N [--nnodes M ...] -m fp4convert quantize SRC DST ...`` starts N x M
copies of the same command. Each plans the whole conversion from the headers (cheap, and the same
everywhere), takes its share of the output shards (:func:`assign`: deterministic, greedy by bytes)
and writes only those, on its own GPU (``LOCAL_RANK``) or on the CPU. Coordination is
``torch.distributed`` with gloo, initialised only when ``WORLD_SIZE > 1``:

- rank 0 prepares the destination (refuse / --overwrite / --resume checks) and tells the others
  what a resume may reuse (:meth:`World.from_rank0`); every rank records its finished shards in its
  own progress file (the run loop, :mod:`fp4convert.run.runner`, treats a rank as parts of the run);
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
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fp4convert.errors import FP4ConvertError, RankFailed, RankStopped

if TYPE_CHECKING:
    from fp4convert.plan.planner import Plan

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

    def calibration_group(self, device: str | None) -> Group:
        """The ranks as a calibration pass exchanges statistics between them: over NCCL when the pass runs on GPUs
        (a group of its own, made now; gloo if NCCL is not there), over gloo on CPUs."""
        return Group(self, device)

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


class Group:
    """A torchrun job's ranks for a calibration pass (:meth:`World.calibration_group`): ``gather(obj)`` returns every
    rank's ``obj`` (tensors inside travel pickled: over NCCL between GPUs, gloo between CPUs)."""

    def __init__(self, world: World, device: str | None) -> None:
        self.world = world
        self.rank, self.size, self.distributed = world.rank, world.size, world.distributed
        self._group = None
        if self.distributed and device is not None and str(device).startswith("cuda"):
            import torch
            import torch.distributed as dist

            try:
                torch.cuda.set_device(torch.device(device))
                self._group = dist.new_group(backend="nccl")
            except Exception as exc:  # noqa: BLE001 - the default (gloo) group still works, slower
                log.warning("calibration statistics exchanged over gloo, NCCL is not usable here (%s)", exc)

    def gather(self, obj) -> list:
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self._group)
        return out

