"""The quantized linears outside the repeated blocks, on the sweep architectures the block runner runs.

For each model_type (tests/tiny_configs.py's tiny checkpoint): the modules a default compressed-tensors
plan quantizes outside the blocks, what :func:`fp4convert.calibrate.tail.blind_spots` says of them
before anything runs (observed, or why not; a refusal of the whole model), and, where some are observed,
whether the runner's statistics equal whole-model forward hooks (amax torch.equal, mean squares within
one bf16 step): the blocks' (tests/calibrate/test_layerwise.py ``compare``), then those outside them
(tests/calibrate/test_tail.py ``compare_outside``); a failure names the first input that differs. CPU.

    PYTHONPATH=. python3 benchmarks/calibration_tail_sweep.py OUT.json [TYPES...]

Without TYPES: the types benchmarks/results/cpu2_20261128_calibration_sweep.json says the runner ran.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one(model_type: str, root: Path) -> dict:
    import torch

    from fp4convert import calibrate
    from fp4convert.calibrate.tail import blind_spots
    from fp4convert.config import ConvertConfig
    from fp4convert.errors import PlanError
    from fp4convert.run.convert import plan_conversion
    from fp4convert.source.open import open_source
    from tests import tiny_configs
    from tests.calibrate.test_layerwise import compare
    from tests.calibrate.test_tail import compare_outside

    built = tiny_configs.build(model_type, root)
    if not built.ok:
        return {"model_type": model_type, "outcome": "not built", "why": built.error}
    _, plan, _ = plan_conversion(str(built.path), ConvertConfig(format="compressed-tensors"))
    lm = calibrate.LayerwiseModel(open_source(str(built.path)), torch.device("cpu"))
    inputs = calibrate.plan_inputs(lm, plan)
    outside = sorted(m.module for d in plan.decisions if d.action == "quantize" for m in d.matrices
                     if not (inputs.get(m.module) or "").startswith(lm.layers_name + "."))
    row: dict = {"model_type": model_type, "outside_quantized": outside}
    try:
        blind, seen = blind_spots(lm, lm._forward, plan, inputs)
    except PlanError as exc:
        return {**row, "outcome": "refused", "why": str(exc)}
    row.update(outcome="ok", observed=sorted(seen), blind=[[b.tensor, b.why] for b in blind])
    if seen:
        row["outside_equal"] = _check(lambda: sorted(n for n in seen if n in compare_outside(
            Path(built.path), vocab=tiny_configs.VOCAB)))
        linears = any(isinstance(m, torch.nn.Linear) for b in lm.layers for m in b.modules())
        row["blocks_equal"] = _check(lambda: compare(Path(built.path), vocab=tiny_configs.VOCAB) is not None) \
            if linears else "no nn.Linear in the blocks"
    return row


def _check(run):
    try:
        return run()
    except AssertionError as exc:
        return f"no: {exc}".splitlines()[0][:200]
    except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
        return f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:200]


def main() -> None:
    out = Path(sys.argv[1])
    types = sys.argv[2:]
    if not types:
        done = json.loads((ROOT / "benchmarks/results/cpu2_20261128_calibration_sweep.json").read_text())
        types = [r["model_type"] for r in done["rows"] if r["outcome"] == "ran"]

    def alarm(*_):
        raise TimeoutError("over 240 s")

    rows = []
    for t in types:
        root = Path(tempfile.mkdtemp(prefix="tail-sweep-"))
        signal.signal(signal.SIGALRM, alarm)
        signal.alarm(240)
        t0 = time.perf_counter()
        try:
            row = one(t, root)
        except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
            row = {"model_type": t, "outcome": "error", "why": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
        finally:
            signal.alarm(0)
            shutil.rmtree(root, ignore_errors=True)
        row["s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row)[:400], flush=True)
        out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
