"""Model-level accuracy of tuned rounding (``--method tuned``) beside GPTQ and llm-compressor's GPTQ (issue 46).

The sibling of benchmarks/accuracy_gptq.py, on its model, held-out text, calibration windows and scoring (imported,
not copied): the converter runs as its command line does (``python -m fp4convert quantize ... --method tuned`` from
this checkout, the command recorded), the folder is decoded exactly (and checked once against transformers'
compressed-tensors load), and the mean next-token KL against the unquantized model is measured on the 2048
held-out tokens. ``--also gptq`` / ``--also rtn`` measure fp4convert's ``--method gptq`` / ``rtn`` on the same
machine in the same run; llm-compressor's GPTQ and our earlier GPTQ figures on the same tokens are read from
accuracy_gptq's recorded rows (``--peers``, its JSON), not run again (its venv is not needed).

Each row records the command, the conversion's seconds and the tuning's per block (the manifest's ``method.blocks``:
the start's and the tuned calibration loss of every block, which one was kept, its seconds), KL / perplexity /
top-1, and the ratios to the peers' KL. ``--blocks N`` quantizes the first N blocks only and records their
calibration losses (no KL): the proxy the defaults were chosen on. The device runs (one H100 or H200; the
models come from the cache of benchmarks/accuracy.py, prepared as accuracy_gptq's docstring says), at the
defaults, each with our GPTQ beside it on the same card:

    for m in smollm2-135m gemma3-270m; do for s in mxfp4 nvfp4; do
        python benchmarks/accuracy_tuned.py --model $m --scheme $s --device cuda --also gptq \
            --json benchmarks/results/h100_<date>_accuracy_tuned_${m}_${s}.json; done; done

Each row's ``block_s`` is the cost per block (GPTQ's start, the calls taken again, the tuning, the guard, the
reload), from the conversion's log.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import fp4convert  # noqa: E402,F401  (this checkout's)

sys.path.insert(1, str(HERE))
import accuracy as acc  # noqa: E402
import accuracy_gptq as agptq  # noqa: E402

log = logging.getLogger("accuracy_tuned")
PEERS = HERE / "results" / "cpu2_20261128_accuracy_gptq_{model}.json"  # accuracy_gptq's rows on the same tokens


def command(a: argparse.Namespace, method: str, checkpoint: Path, dst: Path, text: Path) -> list[str]:
    """The ``fp4convert quantize`` command line of one row (``method``: tuned, gptq or rtn)."""
    cmd = ["fp4convert", "quantize", str(checkpoint), str(dst), "--scheme", a.scheme, "--format", "compressed-tensors",
           "--device", a.device, "--overwrite"]
    if method == "rtn":
        return cmd
    cmd += ["--method", method, "--calibration-data", str(text), "--calibration-samples", str(a.samples),
            "--calibration-seq-len", str(a.calib_len)]
    if a.blocks:  # (a proxy for choosing settings: the first blocks quantized, the rest run as they are)
        cmd += ["--only", "re:\\.layers\\.(" + "|".join(str(i) for i in range(a.blocks)) + ")\\."]
    if method == "tuned":
        for flag, value in (("--tuned-iters", a.iters), ("--tuned-lr", a.lr), ("--tuned-scale-lr", a.scale_lr),
                            ("--tuned-batch", a.batch), ("--tuned-seed", a.seed)):
            if value is not None:
                cmd += [flag, str(value)]
        if a.start:
            cmd += [f"--tuned-start-{a.start}"]
    return cmd


def convert(cmd: list[str], log_path: Path) -> float:
    """Run the command with this checkout's package (its log, progress included, to ``log_path``); its seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t = time.time()
    with open(log_path, "w") as out:
        r = subprocess.run([sys.executable, "-m", "fp4convert", *cmd[1:]], env=env, stdout=out, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise RuntimeError(f"exit {r.returncode}: {log_path.read_text()[-1500:]}")
    return time.time() - t


def peers(model: str, scheme: str) -> dict[str, dict]:
    """accuracy_gptq's recorded rows of this model and weight-only setting: llm-compressor's GPTQ, our GPTQ rows."""
    path = Path(str(PEERS).format(model=model))
    if not path.exists():
        return {}
    rows = json.loads(path.read_text()).get("rows", [])
    return {r["spec"]: {"kl": r["kl"], "ppl": r.get("ppl"), "top1": r.get("top1"), "command": r.get("command"),
                        "source": str(path.relative_to(ROOT))}
            for r in rows if r.get("setting") == scheme and "kl" in r and (r["method"] in ("llmc-gptq", "gptq"))}


def measure(a: argparse.Namespace, method: str, checkpoint: Path, bench: acc.Bench | None, work: Path, text: Path
            ) -> dict:
    dst = work / f"fp4c-{a.scheme}-{method}"
    cmd = command(a, method, checkpoint, dst, text)
    load0 = os.getloadavg()[0]
    secs = convert(cmd, work / f"{dst.name}.log")
    manifest = json.loads((dst / "fp4convert.json").read_text())
    row: dict = {"method": method, "command": " ".join(cmd), "convert_s": round(secs, 1),
                 "settings": manifest.get("settings", {}).get("method")}
    rec = manifest.get("method") or {}
    blocks = rec.get("blocks")
    if blocks:
        row["blocks"] = blocks
        row["blocks_tuned"] = rec.get("blocks_tuned")
        took = [float(x) for x in re.findall(r"tuned: block \d+ took ([0-9.]+) s", (work / f"{dst.name}.log").read_text())]
        row["block_s"] = took  # (the conversion's log: start, tuning and reload of each block)
        row["block_s_mean"] = round(sum(took) / max(len(took), 1), 2)
        row["start_loss_sum"] = sum(b.get("start_loss", 0.0) for b in blocks.values())
        row["kept_loss_sum"] = sum(b["tuned_loss"] if b.get("kept") == "tuned" else b.get("start_loss", 0.0)
                                   for b in blocks.values())
    if bench is None:
        return row
    t = time.time()
    acc.check_loaders(dst, bench.linears)
    w = acc.decode_compressed_tensors(dst, bench.linears)
    row.update(acc.evaluate(bench, w), weight_rel_mse=acc.weight_mse(bench, w), eval_s=round(time.time() - t, 1),
               checked_against_transformers=True, load_avg_1m=[round(load0, 2), round(os.getloadavg()[0], 2)])
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(acc.MODELS))
    p.add_argument("--scheme", default="mxfp4", choices=["mxfp4", "nvfp4"])
    p.add_argument("--iters", type=int, help="--tuned-iters (default: the method's)")
    p.add_argument("--lr", type=float, help="--tuned-lr")
    p.add_argument("--scale-lr", type=float, help="--tuned-scale-lr")
    p.add_argument("--batch", type=int, help="--tuned-batch")
    p.add_argument("--seed", type=int, help="--tuned-seed")
    p.add_argument("--start", choices=["gptq", "rtn"], help="--tuned-start-gptq / --tuned-start-rtn")
    p.add_argument("--also", nargs="*", default=[], choices=["gptq", "rtn"], help="also measure these methods")
    p.add_argument("--blocks", type=int, help="quantize only the first N blocks and record their calibration losses "
                   "(start and kept), no KL: the proxy the defaults were chosen on")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--calib-len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored (accuracy_gptq's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int)
    p.add_argument("--cache", default=str(acc.DEFAULT_CACHE))
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t0 = time.time()
    cache = Path(a.cache)
    checkpoint = acc.export_checkpoint(a.model, cache)
    work = cache / a.model / "tuned"
    text, _, tokens = agptq.calibration(checkpoint, work, a.samples, a.calib_len)
    bench = None if a.blocks else acc.load_bench(a.model, a.tokens, 512, 4, cache, threads=a.threads)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    path = Path(a.json)
    result = json.loads(path.read_text()) if path.exists() else {
        "model": a.model, "scheme": a.scheme, **({"base_ppl": bench.base_ppl, "tokens": int(bench.ids.numel())} if bench
                                                 else {}),
        "calibration": {"samples": int(tokens.shape[0]), "seq_len": int(tokens.shape[1])}, "rows": []}
    result["peers"] = peers(a.model, a.scheme)
    for method in ["tuned", *a.also]:
        row = measure(a, method, checkpoint, bench, work, text)
        for spec, peer in result["peers"].items() if "kl" in row else ():
            row[f"kl_vs_{spec.replace(':', '_')}"] = round(row["kl"] / peer["kl"], 4)
        row.update(commit=head, date=datetime.date.today().isoformat(),
                   device=(torch.cuda.get_device_name() if a.device == "cuda" else
                           f"CPU ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"),
                   bench_command=" ".join(["python", "benchmarks/accuracy_tuned.py", *(argv or sys.argv[1:])]))
        result["rows"].append(row)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        if "kl" in row:
            log.info("%s: KL %.4f ppl %.3f top-1 %.4f (%.0f s)", method, row["kl"], row["ppl"], row["top1"], row["convert_s"])
        else:
            log.info("%s: blocks' calibration loss %.6f -> %.6f (%.0f s)", method, row.get("start_loss_sum", 0.0),
                     row.get("kept_loss_sum", 0.0), row["convert_s"])
    log.info("done in %.0f s", time.time() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
