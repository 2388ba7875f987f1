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
from pathlib import Path
from typing import TYPE_CHECKING

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
