"""What the calibrated settings cost end to end against the data-free conversion.

One checkpoint (``benchmarks/e2e_vs_copy.py``'s dense 8B-shaped layers, random bf16 weights, a real
Llama config, plus a character-level tokenizer so samples can be self-generated), converted with each
row's options, defaults otherwise: ``none`` (the data-free default), ``random`` (``--input-weights
random``), ``w4a4`` (``--activations nvfp4 --format compressed-tensors``: calibration on self-generated
samples at the default shape), ``gptq`` (``--method gptq``, self-generated samples at the default
shape), ``gptq_w4a4`` (the same with ``--activations nvfp4``); rows interleaved, ``sync`` after each,
median of ``--repeats``; each command a fresh process, start-up included. Prints and writes
(``--json``) every run (wall time, peak host RSS and peak GPU memory from the CLI's ``--json``) and the
medians as ratios of ``none``.

    python benchmarks/iw_cost.py --layers 8 --device auto --rows none random w4a4 gptq --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_vs_copy  # noqa: E402

ROWS = {
    "none": [],
    "random": ["--input-weights", "random"],
    "w4a4": ["--activations", "nvfp4", "--format", "compressed-tensors"],
    "gptq": ["--method", "gptq"],
    # GPTQ on a calibration file of the default shape (16 x 256 tokens): no generation, the tokens llm-compressor gets
    "gptq_file": ["--method", "gptq", "--calibration-data", "{calibration}"],
    # GPTQ with NVFP4 activations (W4A4): self-generated samples, the asymmetric objective (docs/numerics.md "GPTQ")
    "gptq_w4a4": ["--method", "gptq", "--activations", "nvfp4", "--format", "compressed-tensors"],
    # W4A4 GPTQ without its default smoothing (--smooth 0)
    "gptq_w4a4_smooth0": ["--method", "gptq", "--smooth", "0", "--activations", "nvfp4", "--format",
                          "compressed-tensors"],
    # the same two with --true-sequential (each block run again before each of its later GPTQ steps)
    "gptq_ts": ["--method", "gptq", "--true-sequential"],
    "gptq_w4a4_ts": ["--method", "gptq", "--true-sequential", "--activations", "nvfp4", "--format",
                     "compressed-tensors"],
    # llm-compressor 0.14's oneshot + GPTQModifier (NVFP4A16, its defaults) on the same 16 x 256 tokens, the model
    # loaded on the GPU in the checkpoint's dtype, saved compressed: a process of its own (--peer-python)
    "llmc_gptq": [],
}
CALIBRATION = (16, 256)  # the converter's default calibration shape (samples, tokens)

LLMC_SNIPPET = """
import json, resource, sys, time, torch
t0 = time.time()
from datasets import Dataset
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
src, dst, tokens = sys.argv[1], sys.argv[2], torch.load(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(src, dtype="auto", device_map="cuda")
ds = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
oneshot(model=model, dataset=ds, recipe=GPTQModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"]),
        num_calibration_samples=tokens.shape[0], max_seq_length=tokens.shape[1])
model.save_pretrained(dst, save_compressed=True)
print(json.dumps({"wall_s": time.time() - t0, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "counts": {"gpu_peak_MB": torch.cuda.max_memory_allocated() / 1e6}}))
"""


def calibration_file(path: Path) -> Path:
    """A calibration text for the character tokenizer: the docstrings of the standard library's modules
    (ASCII), at least the default calibration's tokens."""
    import importlib

    parts = []
    for name in sorted(sys.stdlib_module_names - {"antigravity", "this"}):
        if name.startswith("_") or len(parts) >= 200:
            continue
        try:
            doc = importlib.import_module(name).__doc__
        except Exception:  # noqa: BLE001 (a module that does not import here has no text for us)
            continue
        if doc:
            parts.append(doc.encode("ascii", "ignore").decode())
    text = "\n\n".join(parts)
    need = CALIBRATION[0] * CALIBRATION[1]
    path.write_text((text + "\n\n") * (need // max(len(text), 1) + 1))
    return path


def calibration_tokens(src: Path, text: Path, out: Path) -> Path:
    """The 16 x 256 token windows fp4convert cuts from ``text`` (its own ``file_tokens``), for the peer."""
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fp4convert.calibrate.samples import file_tokens

    tok = transformers.AutoTokenizer.from_pretrained(str(src))
    torch.save(file_tokens(tok, text, *CALIBRATION), out)
    return out


def char_tokenizer(path: Path) -> None:
    """A character-level tokenizer (ids < 128) beside the checkpoint: self-generation needs one (the
    tests' own, tests/calibrate/test_calibrate.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.calibrate.test_calibrate import add_tokenizer

    add_tokenizer(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/iw_cost"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", nargs="+", default=["auto"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu-repeats", type=int, default=None, help="repeats of the cpu rows (default: --repeats)")
    ap.add_argument("--rows", nargs="+", default=["none", "random"], choices=list(ROWS))
    ap.add_argument("--warmup", action="store_true",
                    help="one untimed run of every row first (kernel build, the imports' bytecode caches: what an "
                         "installed package already has)")
    ap.add_argument("--peer-python", default=sys.executable, help="the python that has llmcompressor (row llmc_gptq)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    src = args.work / "src"
    if not (src / "config.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        e2e_vs_copy.dense(src, args.layers)
    if not (src / "tokenizer.json").exists():
        char_tokenizer(src)
    size = sum(p.stat().st_size for p in src.iterdir())
    text = args.work / "calibration.txt"
    if {"gptq_file", "llmc_gptq"} & set(args.rows):
        calibration_file(text)
    if "llmc_gptq" in args.rows:
        calibration_tokens(src, text, args.work / "calibration_tokens.pt")

    def command(dev: str, row: str, out: Path) -> list[str]:
        if row == "llmc_gptq":
            return [args.peer_python, "-c", LLMC_SNIPPET, str(src), str(out), str(args.work / "calibration_tokens.pt")]
        return [sys.executable, "-m", "fp4convert", "quantize", str(src), str(out), "--device", dev, "--json",
                *(a.format(calibration=text) for a in ROWS[row])]

    e2e_vs_copy.warm(src)
    runs = []
    rows = [(d, iw) for d in args.device for iw in args.rows]
    if args.warmup:
        for d in args.device:
            for row in dict.fromkeys([*args.rows, "random"]):  # every row's imports compiled once
                out = args.work / "out"
                shutil.rmtree(out, ignore_errors=True)
                subprocess.run(command(d, row, out), capture_output=True)
    for rep in range(args.repeats):
        for dev, iw in rows:
            if dev == "cpu" and args.cpu_repeats is not None and rep >= args.cpu_repeats:
                continue
            out = args.work / "out"
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"])
            cmd = command(dev, iw, out)
            t0 = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            subprocess.run(["sync"])
            wall = time.perf_counter() - t0
            if r.returncode:
                print(r.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{dev} {iw}: exit {r.returncode}")
            try:
                res = json.loads(r.stdout)
            except json.JSONDecodeError:  # (the peer prints its record last)
                res = json.loads(r.stdout.strip().splitlines()[-1])
            rss = res.get("peak_rss_bytes", 0) / 1e9
            gpu = res.get("counts", {}).get("gpu_peak_MB", 0) / 1e3
            runs.append({"device": dev, "input_weights": iw, "rep": rep, "wall_s": round(wall, 3),
                         "run_s": res.get("wall_s"),  # the conversion itself, without the process's start-up
                         "peak_rss_GB": round(rss, 2), "gpu_peak_GB": round(gpu, 2), "stages_s": res.get("stages_s")})
            print(f"rep {rep} --device {dev:4} {iw:6}: {wall:7.2f} s  peak RSS {rss:.2f} GB  GPU {gpu:.2f} GB", flush=True)
    med = {f"{d} {iw}": statistics.median(r["wall_s"] for r in runs if (r["device"], r["input_weights"]) == (d, iw))
           for d, iw in rows}
    for k, v in med.items():
        base = med[k.split()[0] + " none"]
        print(f"median {k:12}: {v:7.2f} s  ({v / base:.2f}x of the data-free run)")
    rec = {"benchmark": "iw_cost", "date": time.strftime("%Y-%m-%d"), "layers": args.layers, "bytes": size,
           "cpus": os.cpu_count(), "runs": runs, "median_s": med,
           "command": "python -m fp4convert quantize SRC OUT --device D --json ROW (defaults otherwise)",
           "rows": {k: ROWS[k] if k != "llmc_gptq" else "llm-compressor oneshot GPTQModifier NVFP4A16, 16 x 256 tokens"
                    for k in args.rows}}
    if args.json:
        args.json.write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
