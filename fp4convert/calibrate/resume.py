"""The statistics stage's result, kept so ``--resume`` after an interruption does not run the model again.

The output folder does not exist yet when the statistics run (they run before anything is written),
so the result is kept beside the model-definition cache (``FP4CONVERT_CALIBRATION_CACHE``, else
``~/.cache/fp4convert/calibration``), under a key over everything it depends on: the fp4convert
version, the options of the pass (data file digest, sample shape, seed, sources, rotation), the
quantized modules, and every source file's name, size and modification time. ``--resume`` reads it;
the run identity recorded with the output (the input weights' digest included) then tells a resume
it is the same run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from fp4convert.quantizer.backend import InputWeight

if TYPE_CHECKING:
    from fp4convert.calibrate.stats import Statistics
    from fp4convert.plan.calibration import CalibrationPlan
    from fp4convert.source.source import Source

log = logging.getLogger(__name__)


def keep_dir() -> Path:
    env = os.environ.get("FP4CONVERT_CALIBRATION_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fp4convert" / "calibration"


def key(source: Source, cal: CalibrationPlan, modules: list[str], device: str | None) -> str | None:
    """The key of this pass (None for a Hub source: nothing local to fingerprint): the calibration plan's
    identity, the quantized modules, the device kind, the fp4convert version and every source file's name,
    size and modification time."""
    from fp4convert.version import __version__

    if source.is_hub:
        return None
    root = Path(source.root)
    files = []
    for p in sorted(root.iterdir()):
        if p.is_file():
            st = p.stat()
            files.append([p.name, st.st_size, st.st_mtime_ns])
    what = {"version": __version__, "root": str(root.resolve()), "files": files, "modules": modules,
            "calibration": cal.identity(), "device": "cpu" if device in (None, "cpu") else "gpu"}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def store_dir(k: str | None) -> Path:
    """Where a pass keyed ``k`` keeps its quantized matrices (a calibrated method's); a fresh temporary folder beside the
    cache for a pass that cannot be kept (a Hub source)."""
    if k is not None:
        return keep_dir() / f"{k}.store"
    import tempfile

    keep_dir().mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="unkept-", suffix=".store", dir=keep_dir()))


def load(k: str | None) -> Statistics | None:
    from fp4convert.calibrate.stats import Statistics
    from fp4convert.calibrate.store import Store

    if k is None:
        return None
    p = keep_dir() / f"{k}.json"
    try:
        obj = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    store = None
    if obj.get("method_record") is not None:
        store = Store.load(store_dir(k))
        if store is None:  # the quantized matrices are gone (written and removed, or never finished)
            return None
    iw = obj.get("input_weights")
    made: dict[str, InputWeight] = {}
    weights = None
    if iw is not None:
        weights = {}
        for m, (src, hexdata) in iw.items():
            if src not in made:
                made[src] = InputWeight(src, bytes.fromhex(hexdata))
            weights[m] = made[src]
    log.info("statistics from the interrupted run kept in %s (the model does not run again)", p)
    return Statistics(obj.get("amax"), obj.get("calibration"), weights, obj.get("input_weight_record"), store,
                      obj.get("method_record"))


def save(k: str | None, st: Statistics) -> None:
    """Keep ``st`` (best effort: a cache that cannot be written only costs a recalibration)."""
    if k is None:
        return
    obj = {"amax": st.amax, "calibration": st.calibration, "input_weight_record": st.input_weight_record,
           "method_record": st.method_record,
           "input_weights": None if st.input_weights is None else
           {m: [w.key, w.data.hex()] for m, w in st.input_weights.items()}}
    d = keep_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{k}.json.partial"
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, d / f"{k}.json")
    except OSError as exc:
        log.debug("calibration result not kept (%s)", exc)


class Checkpoint(Protocol):
    """What the block runner asks of a pass's checkpoint (:meth:`fp4convert.calibrate.layerwise.LayerwiseModel.blocks`)."""

    def start(self, batches: int) -> tuple[int, list] | None:
        """(the first block to run, the hidden states entering it per micro-batch) of an interrupted pass, or None."""
        ...

    def save(self, done: int, hidden: list) -> None:
        """Blocks ``0 .. done-1`` are finished; ``hidden``: the inputs of block ``done``."""
        ...


SAVE_EVERY_S = 60.0  # a pass's state larger than SMALL is kept at most this often (a resume redoes the blocks since)
SMALL = 256 << 20  # ... a smaller one after every block


class PassCheckpoint:
    """A calibration pass's progress, kept as its blocks finish (``--resume`` after a Ctrl-C, a kill or an
    out-of-memory stop continues at the block it was kept at, with the bytes of an uninterrupted run): the hidden
    states entering the next block, the observers' statistics (amax, mean squares: never a Hessian, a pass drops
    a block's once done), the method's own state (``state`` / ``restore``), and the blocks its store holds on disk
    (``store``: flushed at each save). Kept in ``root`` (the resume cache's folder of the pass); None: nothing."""

    def __init__(self, root: Path | None, observers, device, state=None, restore=None, store=None) -> None:
        self.root = None if root is None else Path(root)
        self.observers, self.device, self.state, self.restore, self.store = observers, device, state, restore, store
        self._last = time.monotonic()

    def start(self, batches: int) -> tuple[int, list] | None:
        from safetensors.torch import load_file

        if self.root is None:
            return None
        try:
            rec = json.loads((self.root / "state.json").read_text())
            if rec.get("batches") != batches:
                return None
            hidden = load_file(str(self.root / "hidden.safetensors"))
            stats = load_file(str(self.root / "observers.safetensors"))
        except (OSError, ValueError, KeyError):
            return None
        self.observers.restore(rec["observers"], stats, self.device)
        if self.restore is not None:
            self.restore(rec.get("method") or {})
        return int(rec["done"]), [hidden[f"h{k}"] for k in range(batches)]

    def save(self, done: int, hidden: list) -> None:
        """Keep the pass's state now if it is small, or once SAVE_EVERY_S passed since the last save."""
        if self.root is None:
            return
        size = sum(h.numel() * h.element_size() for h in hidden)
        if size > SMALL and time.monotonic() - self._last < SAVE_EVERY_S:
            return
        from safetensors.torch import save_file

        from fp4convert import timing

        with timing.timed("calibrate_checkpoint"):
            if self.store is not None:
                self.store.persist_partial()  # (the finished blocks' bytes on disk first)
            record, stats = self.observers.state()
            tmp = self.root.with_name(self.root.name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file({f"h{k}": h.detach().contiguous().cpu() for k, h in enumerate(hidden)}, str(tmp / "hidden.safetensors"))
            save_file(stats, str(tmp / "observers.safetensors"))
            (tmp / "state.json").write_text(json.dumps({"done": done, "batches": len(hidden), "observers": record,
                                                        "method": self.state() if self.state is not None else {}}))
            shutil.rmtree(self.root, ignore_errors=True)
            os.replace(tmp, self.root)
        self._last = time.monotonic()

    def remove(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def pass_dir(k: str | None, which: str = "") -> Path | None:
    """Where a pass keyed ``k`` keeps its progress (``which``: one of several passes of a run, e.g. "random"); None
    for a pass that cannot be kept (a Hub source)."""
    return None if k is None else keep_dir() / f"{k}{'.' + which if which else ''}.pass"
