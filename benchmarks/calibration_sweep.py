"""Which sweep architectures the block-by-block calibration runner runs, and why the others not.

For every model_type the architecture sweep builds (tests/tiny_configs.py: tiny random checkpoints of
real transformers classes, saved as users download them), build the checkpoint and run
``fp4convert.calibrate.LayerwiseModel.observe`` on a few random token ids on the CPU; record
ran / refused (the runner's own one-line reason) / failed (an exception the runner does not turn
into a refusal: a bug or a gap). The model types come from benchmarks/results/model_sweep.json
(those the sweep built), else every model_type transformers knows.

``--method gptq``: instead of observing, the GPTQ pass itself (``fp4convert.calibrate.methods.gptq``,
NVFP4 at the default rule, on the plan of a default conversion) on the same token ids; a row that ran
also says how many of the plan's quantized matrices inside the blocks GPTQ quantized (``gptq``) and
how many it never saw an input of (``unseen``, left to round-to-nearest).

    PYTHONPATH=. python3 benchmarks/calibration_sweep.py OUT.json [--root DIR] [--method gptq] [TYPES...]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one(model_type: str, root: Path, timeout: int, method: str = "observe") -> dict:
    import torch

    from fp4convert import calibrate
    from fp4convert.source.open import open_source
    from tests import tiny_configs

    built = tiny_configs.build(model_type, root)
    if not built.ok:
        return {"model_type": model_type, "outcome": "not built", "why": built.error}
    out = {"model_type": model_type, "class": built.model_class, "kind": built.kind}

    def alarm(*_):
        raise TimeoutError(f"over {timeout} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout)
    t0 = time.perf_counter()
    try:
        tokens = torch.randint(3, 60, (2, 16), generator=torch.Generator().manual_seed(0))
        if method == "gptq":
            out.update(gptq_pass(built.path, tokens, root / "stores" / model_type))
        else:
            lm = calibrate.LayerwiseModel(open_source(built.path), torch.device("cpu"))
            obs = calibrate.Observers()
            lm.observe(tokens, obs, progress=False)
            out.update(outcome="ran", blocks=len(lm.layers), observed=len(obs),
                       experts=sum(1 for n in obs if ":down:" in n))
    except calibrate.PlanError as exc:
        out.update(outcome="refused", why=str(exc).split(": ", 1)[-1][:300])
    except BaseException as exc:  # noqa: BLE001 - recorded, the sweep goes on
        if isinstance(exc, KeyboardInterrupt):
            raise
        out.update(outcome="failed", why=f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        whole = whole_model_fails(built.path)
        if whole:  # the tiny config itself cannot run a forward: not the runner's failure
            out.update(outcome="model fails", why=f"the whole model's own forward fails too: {whole}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def gptq_pass(path: str, tokens, store_dir: Path) -> dict:
    """The GPTQ pass on a default conversion's plan: (outcome, blocks, matrices quantized, unseen)."""
    import torch

    from fp4convert import calibrate
    from fp4convert.calibrate.methods.gptq import GPTQ
    from fp4convert.calibrate.steps import block_decisions
    from fp4convert.calibrate.store import Store
    from fp4convert.config import ConvertConfig
    from fp4convert.run.convert import plan_conversion

    from fp4convert.calibrate.methods import settings

    config = ConvertConfig(method=settings("gptq"), device="cpu", allow_no_config=True)
    source, plan, _ = plan_conversion(path, config)
    lm = calibrate.LayerwiseModel(source, torch.device("cpu"))
    store = Store.create(store_dir)
    try:
        g = GPTQ(lm, plan, config, config.method_settings, calibrate.plan_inputs(lm, plan), store)
        g.run(tokens, calibrate.Observers(hessian=True), head=False, micro_batch=8, progress=False)
        store.finish()
        in_blocks = sum(len(d.matrices) for ds in block_decisions(lm, plan).values() for d in ds)
        return {"outcome": "ran", "blocks": len(lm.layers), "in_blocks": in_blocks, "gptq": len(store.index),
                "unseen": len(g.unseen), "unseen_e.g.": g.unseen[:2]}
    finally:
        store.remove()


def whole_model_fails(path: str) -> str | None:
    """Why transformers' own whole-model forward fails on the same tokens (None: it runs)."""
    import torch
    import transformers as tf

    from fp4convert.calibrate.model import model_class

    try:
        cfg = tf.AutoConfig.from_pretrained(path)
        cls = model_class(tf, cfg, list(json.loads((Path(path) / "config.json").read_text()).get("architectures") or []))
        model = cls.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            model(input_ids=torch.randint(3, 60, (2, 16), generator=torch.Generator().manual_seed(0)), use_cache=False)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--root", default="/tmp/fp4convert_calibration_sweep")
    ap.add_argument("--timeout", type=int, default=60)
    ap.add_argument("--method", choices=["observe", "gptq"], default="observe")
    ap.add_argument("types", nargs="*")
    args = ap.parse_args()
    types = args.types
    if not types:
        sweep = ROOT / "benchmarks" / "results" / "model_sweep.json"
        if sweep.is_file():
            outcomes = json.loads(sweep.read_text())["outcomes"]
            types = sorted(t for t, o in outcomes.items() if o.get("status", o.get("outcome")) not in ("skipped",))
        else:
            from tests.tiny_configs import model_types

            types = model_types()
    rows = []
    for t in types:
        r = one(t, Path(args.root), args.timeout, args.method)
        rows.append(r)
        print(json.dumps(r), flush=True)
        Path(args.out).write_text(json.dumps({"counts": Counter(x["outcome"] for x in rows), "rows": rows}, indent=1))
    print(json.dumps(Counter(x["outcome"] for x in rows)))


if __name__ == "__main__":
    main()
