"""W4A4 calibration speed and memory on a GPU (issue 24): one device call.

Builds the dense Llama-3-8B-shaped checkpoint of benchmarks/e2e_vs_copy.py (``--layers`` layers,
bf16, random weights) with a character-level tokenizer, and a calibration text file (the docstrings
of Python's standard library modules). Then, each in a fresh process (so the peaks are its own):

- the plain W4A16 conversion (``--format compressed-tensors``);
- the W4A4 conversion with calibration (``--activations nvfp4 --calibration-data FILE``, ``--samples``
  x ``--seq-len`` tokens);
- calibration alone (``fp4convert.calibrate``) on the same files with the config narrowed to 2, 4 and
  all layers, for peak memory against layer count.

Each row: wall seconds, peak host memory (VmHWM of the process), peak device memory
(``torch.cuda.max_memory_allocated``) and the converter's stage times.

    python benchmarks/calibration_speed.py --work /tmp/cal --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
import torch
sys.path.insert(0, sys.argv[1])
mode, src, dst, data, samples, seq_len = sys.argv[2:8]
t0 = time.perf_counter()
out = {}
if mode == "calibrate-only":
    from fp4convert import calibrate
    from fp4convert.source.open import open_source
    from transformers import AutoTokenizer
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(src)
    tokens = calibrate.file_tokens(tok, data, int(samples), int(seq_len))
    lm = calibrate.LayerwiseModel(open_source(src), dev)
    amax = calibrate.layerwise_amax(lm, tokens)
    out.update(layers=len(lm.layers), linears=len(amax), peak_weight_bytes=lm.peak_loaded)
else:
    from fp4convert.config import ConvertConfig
    from fp4convert.run.convert import convert
    extra = {} if mode == "w4a16" else dict(activations="nvfp4", calibration_data=data,
                                            calibration_samples=int(samples), calibration_seq_len=int(seq_len))
    r = convert(src, dst, ConvertConfig(format="compressed-tensors", overwrite=True, **extra))
    out.update(r.to_json().get("stages_s", {}) and {"stages_s": r.to_json()["stages_s"]})
out["wall_s"] = round(time.perf_counter() - t0, 2)
out["peak_host_bytes"] = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
out["peak_device_bytes"] = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
print(json.dumps(out))
"""


def add_tokenizer(path: Path) -> Path:
    """A character-level tokenizer (as tests/calibrate/test_calibrate.py writes one): calibration needs one."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)])}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(path))
    return path


def stdlib_text(path: Path, repeat: int = 1) -> Path:
    import importlib
    import pkgutil

    texts = []
    for m in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        if m.name.startswith("_") or m.name in ("antigravity", "this", "idlelib", "tkinter", "turtle"):
            continue
        if not getattr(m.module_finder, "path", "").endswith(("python3.11", "python3.12", "python3.10")):
            continue
        try:
            mod = importlib.import_module(m.name)
        except Exception:  # noqa: BLE001
            continue
        if mod.__doc__:
            texts.append(mod.__doc__.strip())
    path.write_text("\n\n".join(texts * repeat) + "\n")
    return path


def narrowed(src: Path, dst: Path, layers: int) -> Path:
    """The same shards (hard links: fp4convert refuses symlinks out of the folder) with config.json's
    layer count narrowed."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            os.link(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def child(mode: str, src: Path, dst: Path, data: Path, samples: int, seq_len: int) -> dict:
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "CUDA_VISIBLE_DEVICES") if k in os.environ}
    r = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), mode, str(src), str(dst), str(data), str(samples),
                        str(seq_len)], capture_output=True, text=True, env=env)
    if r.returncode:
        return {"error": r.stderr[-2000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--work", default="/tmp/cal")
    p.add_argument("--out", default=None)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--small", action="store_true", help="a tiny model (a CPU smoke test of this script)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks import e2e_vs_copy

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / "dense"
    t = time.time()
    if args.small:
        from tests.test_calibrate import _deep

        _deep(src, args.layers)
    else:
        e2e_vs_copy.dense(src, args.layers)
        add_tokenizer(src)
    built = time.time() - t
    data = stdlib_text(work / "calibration.txt", repeat=4)
    rows = {"build_s": round(built, 1), "samples": args.samples, "seq_len": args.seq_len}
    rows["w4a16"] = child("w4a16", src, work / "o16", data, args.samples, args.seq_len)
    rows["w4a4_calibrated"] = child("w4a4", src, work / "o4", data, args.samples, args.seq_len)
    for n in sorted({2, 4, args.layers}):
        rows[f"calibrate_only_{n}_layers"] = child("calibrate-only", narrowed(src, work / f"n{n}", n), work, data,
                                                   args.samples, args.seq_len)
    text = json.dumps(rows, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "calibration_speed.json").write_text(text + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
