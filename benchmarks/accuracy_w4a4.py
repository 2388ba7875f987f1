"""Model-level accuracy of W4A4 (weights and activations in FP4), beside llm-compressor's ``oneshot``.

Extends benchmarks/accuracy.py (imported, not copied: the same model, held-out text, base
log-probabilities and scoring) with activation quantization, evaluated as the engines run W4A4:

- the weights are those of the converted compressed-tensors folder (decoded exactly, as
  benchmarks/accuracy.py does);
- every quantized linear's input is quantized on the fly per 16-block (NVFP4: E4M3 block scale
  ``E4M3(gs * bmax / 6)`` under the checkpoint's stored ``input_global_scale`` gs, the elements E2M1
  under ``gs / sf``, saturating) or per 32-block (MXFP4: dynamic E8M0, the reference's OCP rule), with
  fp4convert's reference primitives (``fp4convert/numerics/reference.py``), by a forward pre-hook.

The hook is checked against compressed-tensors' own activation quantization (transformers 5.24 +
compressed-tensors 0.20 load ``input_global_scale`` and fake-quantize activations in the forward):
on one batch, each linear's output as compressed-tensors computes it (bf16) is compared with
``x_q @ W^T`` from our hook; the report gives the relative difference, beside the one with the
activations left unquantized.

Variants (same model, same eval tokens):

- fp4convert NVFP4 W4A4 calibrated from a text file (real English prose that is not the eval text:
  the docstrings of Python's standard library modules, sorted, written to a file);
- fp4convert NVFP4 W4A4 calibrated from self-generated samples (no data);
- fp4convert NVFP4 W4A4 with ModelOpt's constant scale (``--activation-scale constant``);
- fp4convert MXFP4 W4A4 (dynamic activations);
- llm-compressor ``oneshot`` NVFP4 (W4A4) on exactly the file-calibration token windows fp4convert
  used (``fp4convert.calibrate.file_tokens``), in its own venv (``--peer-python``);
- W4A16 NVFP4 (the weights alone) for reference.

    python -m venv --system-site-packages /tmp/llmc && /tmp/llmc/bin/pip install llmcompressor
    PYTHONPATH=benchmarks python benchmarks/accuracy_w4a4.py --peer-python /tmp/llmc/bin/python \\
        --json benchmarks/results/accuracy_w4a4_smollm2-135m.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import fp4convert  # noqa: E402,F401  (this checkout's, before accuracy.py puts its own root first)
from fp4convert.numerics import reference as ref  # noqa: E402
from fp4convert.calibrate import file_tokens  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))
import accuracy as acc  # noqa: E402

log = logging.getLogger("accuracy_w4a4")

ONESHOT_SNIPPET = """
import sys, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
src, dst, tokens = sys.argv[1], sys.argv[2], torch.load(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(src)
ds = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
oneshot(model=model, dataset=ds, recipe=QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"]),
        num_calibration_samples=tokens.shape[0], max_seq_length=tokens.shape[1])
model.save_pretrained(dst, save_compressed=True)
tok.save_pretrained(dst)
"""


# ---------------------------------------------------------------------------------------------
# Activation quantization as the engines apply it
# ---------------------------------------------------------------------------------------------

def nvfp4_act(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """x quantized and dequantized per 16-block along its last dim under the static encode scale gs."""
    v = x.to(torch.float32)
    blocks = v.reshape(*v.shape[:-1], -1, ref.NVFP4_BLOCK)
    gsb = gs.to(torch.float32).reshape(())
    scale = ref._nvfp4_choose(blocks, gsb, blocks.abs().amax(-1), "max")
    codes, d = ref.nvfp4_candidate(blocks, gsb, scale)
    return (ref.e2m1_decode(codes) * d[..., None]).reshape(v.shape).to(x.dtype)


def mxfp4_act(x: torch.Tensor) -> torch.Tensor:
    v = x.to(torch.float32)
    flat = v.reshape(-1, v.shape[-1])
    packed, e = ref.mxfp4_quantize(flat)
    return ref.mxfp4_dequantize(packed, e).reshape(v.shape).to(x.dtype)


def input_scales(folder: Path) -> dict[str, torch.Tensor]:
    """module -> stored input_global_scale of a compressed-tensors folder."""
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if k.endswith(".input_global_scale"):
                    out[k[: -len(".input_global_scale")]] = h.get_tensor(k).float()
    return out


def nvfp4_hook(folder: Path):
    scales = input_scales(folder)
    return lambda name, x: nvfp4_act(x, scales[name])


def compare_with_compressed_tensors(bench: acc.Bench, folder: Path, layers: int = 4) -> dict:
    """Our hook vs compressed-tensors' own activation quantization, linear by linear, on one batch."""
    import contextlib
    import io

    from transformers import AutoModelForCausalLM

    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    weights = acc.decode_compressed_tensors(folder, bench.linears)
    scales = input_scales(folder)
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    wanted = [w[: -len(".weight")] for w in bench.linears if any(f".layers.{i}." in w for i in range(layers))]
    mods = dict(model.named_modules())
    hooks = [mods[n].register_forward_hook(lambda m, a, y, _n=n: seen.__setitem__(_n, (a[0].detach(), y.detach())))
             for n in wanted]
    with torch.no_grad():
        model(bench.ids[:1, :128])
    for h in hooks:
        h.remove()
    ours, plain = [], []
    for n, (x, y) in seen.items():
        w = weights[n + ".weight"]
        y = y.float()
        mine = nvfp4_act(x.float(), scales[n]) @ w.T
        raw = x.float() @ w.T
        ours.append(((mine - y).norm() / y.norm()).item())
        plain.append(((raw - y).norm() / y.norm()).item())
    return {"linears": len(seen), "rel_diff_ours_max": max(ours), "rel_diff_ours_mean": sum(ours) / len(ours),
            "rel_diff_unquantized_activations_mean": sum(plain) / len(plain)}


# ---------------------------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------------------------

def stdlib_docstrings(path: Path) -> Path:
    """Calibration text: the docstrings of Python's standard library modules (sorted), one file."""
    import importlib
    import pkgutil

    texts = []
    for name in sorted(m.name for m in pkgutil.iter_modules() if m.module_finder.path.endswith(("lib/python3.11",
                                                                                              "lib/python3.12"))):
        if name.startswith("_") or name in ("antigravity", "this", "idlelib", "tkinter", "turtle", "pydoc_data"):
            continue
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 (some stdlib modules need a display or a platform)
            continue
        if mod.__doc__:
            texts.append(mod.__doc__.strip())
    path.write_text("\n\n".join(texts) + "\n")
    return path


def convert(bench: acc.Bench, dst: Path, **cfg) -> Path:
    from fp4convert.config import ConvertConfig
    from fp4convert.run.convert import convert as run

    run(str(bench.checkpoint), str(dst), ConvertConfig(format="compressed-tensors", device="cpu", overwrite=True, **cfg))
    return dst


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    t0 = time.time()
    bench = acc.load_bench(args.model, args.tokens, args.seq_len, args.batch, Path(args.cache), threads=args.threads)
    log.info("%s: base ppl %.3f on %d tokens (%.0f s)", args.model, bench.base_ppl, bench.ids.numel(), time.time() - t0)
    work = Path(args.cache) / args.model / "w4a4"
    work.mkdir(parents=True, exist_ok=True)
    data = stdlib_docstrings(work / "calibration.txt")
    tok = AutoTokenizer.from_pretrained(bench.checkpoint)
    calib = file_tokens(tok, data, args.samples, args.calib_len)
    torch.save(calib, work / "calibration_tokens.pt")
    cal = dict(calibration_samples=args.samples, calibration_seq_len=args.calib_len)
    rows, extra = [], {}

    def add(variant: str, folder: Path, hook, secs: float) -> None:
        t = time.time()
        w = acc.decode_compressed_tensors(folder, bench.linears)
        rows.append({"variant": variant, **acc.evaluate(bench, w, hook), "convert_s": round(secs, 1)})
        log.info("%s (convert %.0f s, eval %.0f s)", rows[-1], secs, time.time() - t)
        if args.json:  # partial results survive an interrupted run
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"partial": True, "rows": rows, **extra}, indent=1) + "\n")

    want = set(args.rows.split(","))
    iw = {} if args.input_weights is None else {"input_weights": args.input_weights}
    iw_label = "" if args.input_weights is None else f" --input-weights {args.input_weights}"
    for rule in ("default", "mse", "4over6"):  # the weights' scale rule (the activations' are the engine's)
        for kind in ("file", "self"):  # calibrated on the text file, or on self-generated samples
            if f"{kind}-{rule}" not in want:
                continue
            t = time.time()
            f = convert(bench, work / f"w4a4-{kind}-{rule}-iw{args.input_weights or 'default'}", scheme="nvfp4",
                        scale_rule=None if rule == "default" else rule, activations="nvfp4",
                        **({"calibration_data": str(data)} if kind == "file" else {}), **cal, **iw)
            add("fp4convert NVFP4 W4A4 " + ("(default rule)" if rule == "default" else f"--scale-rule {rule}")
                + iw_label + (", calibrated on a text file" if kind == "file" else ", self-generated calibration"),
                f, nvfp4_hook(f), time.time() - t)
    if "file" not in want:  # only the rows asked for (no peer, no ratios): what was run, for the record
        return {"rows": rows, "base_ppl": bench.base_ppl, "partial": True, "model": args.model,
                "tokens": int(bench.ids.numel()), "calibration": {"samples": int(calib.shape[0]),
                                                                  "seq_len": int(calib.shape[1])},
                "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv)}
    t = time.time()
    f = convert(bench, work / "w4a16", scheme="nvfp4")
    add("fp4convert NVFP4 W4A16 (weights only)", f, None, time.time() - t)
    t = time.time()
    f = convert(bench, work / "w4a4-file", scheme="nvfp4", activations="nvfp4", calibration_data=str(data), **cal)
    add("fp4convert NVFP4 W4A4, calibrated on a text file", f, nvfp4_hook(f), time.time() - t)
    try:
        extra["hook_vs_compressed_tensors"] = compare_with_compressed_tensors(bench, f)
    except Exception as exc:  # noqa: BLE001 (recorded: transformers' load of this model is not ours)
        extra["hook_vs_compressed_tensors"] = {"error": f"{type(exc).__name__}: {exc}"}
    log.info("hook vs compressed-tensors: %s", extra["hook_vs_compressed_tensors"])
    if args.peer_python:
        t = time.time()
        dst = work / "llmc-oneshot-nvfp4"
        with open(work / "llmc.log", "w") as err:
            r = subprocess.run([args.peer_python, "-c", ONESHOT_SNIPPET, str(bench.checkpoint), str(dst),
                                str(work / "calibration_tokens.pt")], stdout=subprocess.DEVNULL, stderr=err)
        if r.returncode == 0:
            add("llm-compressor oneshot NVFP4 (W4A4), same calibration tokens", dst, nvfp4_hook(dst), time.time() - t)
        else:
            extra["oneshot_error"] = (work / "llmc.log").read_text()[-1500:]
            log.info("oneshot failed: %s", extra["oneshot_error"])
    t = time.time()
    f = convert(bench, work / "w4a4-self", scheme="nvfp4", activations="nvfp4", **cal)
    add("fp4convert NVFP4 W4A4, self-generated calibration", f, nvfp4_hook(f), time.time() - t)
    t = time.time()
    f = convert(bench, work / "w4a4-mx", scheme="mxfp4", activations="mxfp4")
    add("fp4convert MXFP4 W4A4 (dynamic activations)", f, lambda n, x: mxfp4_act(x), time.time() - t)
    t = time.time()
    f = convert(bench, work / "w4a4-const", scheme="nvfp4", activations="nvfp4", activation_scale="constant")
    add("fp4convert NVFP4 W4A4, constant scale (amax 2688)", f, nvfp4_hook(f), time.time() - t)
    peer = [r for r in rows if r["variant"].startswith("llm-compressor")]
    file_row = rows[1]
    rows.sort(key=lambda r: r["variant"].startswith("llm-compressor"))
    for r in rows:
        r["kl_vs_oneshot"] = r["kl"] / peer[0]["kl"] if peer else None
        r["kl_vs_file_calibration"] = r["kl"] / file_row["kl"]
    return {
        "model": args.model, "text": "pydoc_data.topics (Python Language Reference), sorted, joined",
        "calibration_text": "docstrings of the standard library modules (sorted, joined)",
        "calibration": {"samples": int(calib.shape[0]), "seq_len": int(calib.shape[1])},
        "python": platform.python_version(), "tokens": int(bench.ids.numel()), "seq_len": args.seq_len,
        "base_ppl": bench.base_ppl,
        "device": f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "wall_s": time.time() - t0,
        "rows": rows, **extra,
    }


def table(result: dict) -> str:
    lines = [f"| variant | perplexity (base {result['base_ppl']:.2f}) | mean KL | top-1 | KL vs oneshot | KL vs file calib. |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        vs = f"{r['kl_vs_oneshot']:.3f}x" if r["kl_vs_oneshot"] is not None else "-"
        lines.append(f"| {r['variant']} | {r['ppl']:.3f} | {r['kl']:.4f} | {r['top1']:.4f} | {vs} | "
                     f"{r['kl_vs_file_calibration']:.3f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(acc.MODELS))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--samples", type=int, default=32, help="calibration samples (every calibrated variant)")
    p.add_argument("--calib-len", type=int, default=256, help="calibration tokens per sample")
    p.add_argument("--peer-python", help="a python with llmcompressor installed (its own venv)")
    p.add_argument("--rows", default="file", help="'file' (every row) and/or {file,self}-{default,mse,4over6} (W4A4 "
                                                  "with that weight scale rule; default: none given), comma-separated")
    p.add_argument("--input-weights", choices=["auto", "none", "random", "calibration"],
                   help="the converter's --input-weights for the file-*/self-* rows (default: the converter's, auto)")
    p.add_argument("--cache", default=str(acc.DEFAULT_CACHE))
    p.add_argument("--threads", type=int)
    p.add_argument("--json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("fp4convert").setLevel(logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_error()
    result = run(args)
    if result.get("partial"):
        print(json.dumps(result["rows"], indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    print(table(result))
    print(json.dumps({k: result[k] for k in ("hook_vs_compressed_tensors",) if k in result}, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
