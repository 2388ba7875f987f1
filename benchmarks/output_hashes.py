"""sha256 of every file the converter writes, for a fixed matrix of checkpoints and settings.

Run it before and after a change that must not move a byte, and diff the two JSON files:

    python benchmarks/output_hashes.py --work /tmp/h > before.json
    ... change ...
    python benchmarks/output_hashes.py --work /tmp/h > after.json && diff before.json after.json

The matrix: the shipped example and a multi-shard MoE (3 source shards, outputs cut at 40 kB), each
in every output format and scheme the format accepts, with and without Had16 where it applies,
plus ``export`` of the native output into each engine format. Same work folder both times: the
manifest records the source path.

The calibrated cases (``CALIBRATED``, ``--method gptq`` and W4A4 on the CPU): tiny zoo models (a dense Llama, a
per-expert MoE, a 3-D-stacked gpt-oss MoE) with a character tokenizer and a fixed calibration text, one torch
thread (``--threads``; docs/numerics.md "GPTQ" says what these bytes depend on).

The scale rules are pinned (``PINNED``: NVFP4 ``max``, MXFP4 ``floor``, the defaults until issue 22), so
the hashes compare like with like across a change of the default rules: the bytes of a pinned run are
those of the old default run (the manifest records the resolved rule either way). ``--defaults`` runs
with no ``--scale-rule`` instead (today NVFP4 ``4over6``, MXFP4 ``wmse``), whose bytes moved with issue 22.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from click.testing import CliRunner  # noqa: E402

from fp4convert.cli.main import main  # noqa: E402
from tests import checkpoints  # noqa: E402

PINNED = {"nvfp4": "max", "mxfp4": "floor"}  # the rule each run uses unless --defaults
MATRIX = [
    ("fp4convert", "nvfp4", None), ("fp4convert", "mxfp4", None), ("fp4convert", "nvfp4", "had16"),
    ("compressed-tensors", "nvfp4", None), ("compressed-tensors", "mxfp4", None),
    ("compressed-tensors", "nvfp4", "had16"), ("modelopt", "nvfp4", None),
]


# (label, zoo family, extra options): the calibrated paths whose bytes a restructure must not move
CALIBRATED = [
    ("gptq-nvfp4", "llama", ["--method", "gptq", "--scale-rule", "mse"]),
    ("gptq-nvfp4-no-ts", "llama", ["--method", "gptq", "--no-true-sequential"]),
    ("gptq-mxfp4-had16", "llama", ["--method", "gptq", "--scheme", "mxfp4", "--rotate", "had16"]),
    ("gptq-w4a4", "llama", ["--method", "gptq", "--activations", "nvfp4", "--format", "compressed-tensors"]),
    ("gptq-moe", "qwen3_moe", ["--method", "gptq"]),
    ("gptq-stacked", "gpt_oss", ["--method", "gptq", "--format", "compressed-tensors"]),
    ("w4a4-rtn", "qwen3_moe", ["--activations", "nvfp4", "--format", "compressed-tensors"]),
    ("iw-calibration", "llama", ["--input-weights", "calibration"]),
]
CALIBRATION_TEXT = ("The quick brown fox jumps over the lazy dog. " * 40 + "Pack my box with five dozen liquor jugs. " * 40)


def calibrated(work: Path) -> dict[str, dict[str, str]]:
    """The CALIBRATED cases' output hashes (each from a fresh zoo model with a tokenizer)."""
    from tests import zoo
    from tests.calibrate.test_calibrate import add_tokenizer

    text = work / "calibration.txt"
    text.write_text(CALIBRATION_TEXT)
    made: dict[str, Path] = {}
    out: dict[str, dict[str, str]] = {}
    for label, family, extra in CALIBRATED:
        if family not in made:
            made[family] = add_tokenizer(zoo.build(family, work / "zoo" / family))
        dst = work / "out" / f"calibrated-{label}"
        run(["quantize", str(made[family]), str(dst), "--device", "cpu", "--quiet", "--calibration-data", str(text),
             "--calibration-samples", "4", "--calibration-seq-len", "48", *extra])
        out[f"calibrated-{label}"] = digest(dst)
    return out


def digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def run(args: list[str]) -> None:
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    if r.exit_code:
        raise SystemExit(f"fp4convert {' '.join(args)} failed ({r.exit_code}): {r.output}")


def main_() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp4convert-hashes"))
    ap.add_argument("--defaults", action="store_true", help="the schemes' default scale rules instead of PINNED")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the calibrated cases' bytes depend on it)")
    ap.add_argument("--only", choices=["plain", "calibrated"], default=None, help="one half of the matrix")
    a = ap.parse_args()
    import os

    os.environ["FP4CONVERT_CALIBRATION_CACHE"] = str(a.work / "calibration-cache")  # (nothing from an earlier run)
    import torch

    torch.set_num_threads(a.threads)
    work: Path = a.work
    shutil.rmtree(work, ignore_errors=True)
    sources = {"tiny-llama": work / "tiny-llama", "moe": work / "moe"}
    shutil.copytree(ROOT / "examples" / "tiny-llama", sources["tiny-llama"])
    checkpoints.moe(sources["moe"], experts=4, shards=3)
    out: dict[str, dict[str, str]] = {}
    for label, src in (sources.items() if a.only != "calibrated" else ()):
        for fmt, scheme, rot in MATRIX:
            name = f"{label}-{fmt}-{scheme}{'-' + rot if rot else ''}"
            dst = work / "out" / name
            run(["quantize", str(src), str(dst), "--format", fmt, "--scheme", scheme, "--device", "cpu",
                 "--max-shard-size", "40kB", "--quiet", *(["--rotate", rot] if rot else []),
                 *([] if a.defaults else ["--scale-rule", PINNED[scheme]])])
            out[name] = digest(dst)
            if fmt == "fp4convert":
                for target in ("compressed-tensors", "modelopt"):
                    if target == "modelopt" and (scheme != "nvfp4" or rot):
                        continue
                    edst = work / "out" / f"{name}-export-{target}"
                    run(["export", str(dst), str(edst), "--format", target, "--max-shard-size", "40kB", "--quiet"])
                    out[edst.name] = digest(edst)
    if a.only != "plain":
        out.update(calibrated(work))
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main_()
