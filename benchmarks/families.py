"""Per model family (tiny random models of real transformers classes, tests/zoo.py): the share of linear
and expert parameters quantized, bits/param, fused groups, and whether transformers loads the
compressed-tensors output (no missing or unexpected keys). Prints a markdown table.

    python benchmarks/families.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import CompressedTensorsConfig  # noqa: E402

from fp4convert.plan import name_roles  # noqa: E402
from fp4convert.config import ConvertConfig  # noqa: E402
from fp4convert.run.convert import convert  # noqa: E402
from tests import zoo  # noqa: E402

KEPT_ROLES = ("router", "embedding", "lm_head", "vision", "projector", "norm", "mtp")


def row(family: str, work: Path) -> dict:
    src = zoo.build(family, work / family)
    dst = work / f"{family}-ct"
    res = convert(src, dst, ConvertConfig(format="compressed-tensors", device="cpu"))
    cfg = json.loads((src / "config.json").read_text())
    plan = res.plan
    total = quant = 0
    for d in plan.decisions:
        role = name_roles.role_of(d.name, d.info.shape, cfg)
        if role in ("linear", "expert"):
            n = math.prod(d.info.shape)
            total += n
            quant += n if d.action == "quantize" else 0
    s = plan.summary()
    f = zoo.FAMILIES[family]
    try:
        _, info = getattr(transformers, f.auto_class).from_pretrained(
            dst, dtype=torch.bfloat16, output_loading_info=True,
            quantization_config=CompressedTensorsConfig(dequantize=False))
        bad = {k: len(v) for k, v in info.items() if v}
        load = "loads" if not bad else "keys: " + ", ".join(f"{k} {v}" for k, v in bad.items())
    except Exception as exc:  # noqa: BLE001 - reported in the table
        load = f"fails: {type(exc).__name__}"
    return {"family": family, "quantized_share": quant / total if total else None,
            "bits_per_param": s["bits_per_param"], "bits_per_param_quantized": s["bits_per_param_quantized"],
            "fused_groups": s["fused_groups"], "transformers_load": load}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row(f, Path(tmp)) for f in zoo.FAMILIES]
    print("| family | linear+expert params quantized | bits/param (all) | bits/param (quantized) | shared-scale groups "
          "| transformers (compressed-tensors) |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {100 * r['quantized_share']:.1f}% | {r['bits_per_param']} | "
              f"{r['bits_per_param_quantized']} | {r['fused_groups']} | {r['transformers_load']} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
