"""A whole-checkpoint fuzzer: mutated checkpoints and mutated finished outputs, run through the CLI.

Every run must end in exit 0 or a documented code (``fp4convert.errors.EXIT_CODES``, never 1) with no
traceback, an error as one line, and within a time limit (no hang). Seeds are small real checkpoints
(a Llama in 3 shards with an index, an FP8 block-scaled Llama, a model card) and finished outputs of
them (native NVFP4, compressed-tensors MXFP4 with had16, ModelOpt).

Mutations, 1-3 per case: a shard's header (tests/storage/test_fuzz_headers.py's mutator) or its data bytes;
the index, config.json, hf_quant_config.json or the manifest as JSON (a value anywhere swapped for
another type, a huge, negative or deeply nested value, a bad regex, a key dropped or added; a config.json
key fp4convert or transformers reads given a value of another type; a number token no float holds, or
NaN/Infinity, written into the text); the model
card's text and front matter; the file system (a FIFO, a folder, a symlink out of the folder or to
/dev/zero in place of a file, a file deleted or truncated). Source cases run ``quantize --dry-run``
(every 8th a real ``quantize``; every output format, W4A4 with constant scales, ``--input-weights
random`` while planning), output cases ``inspect`` (every 3rd ``--check-files``) and ``export``.

Under pytest: a fixed seed and a bounded count (:data:`CI_MUTATIONS`). As a script, any count::

    PYTHONPATH=$PWD python tests/e2e/test_fuzz_checkpoints.py --mutations 20000 [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # script mode: the repo root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from click.testing import CliRunner

from fp4convert.cli.main import main as cli
from fp4convert.errors import EXIT_CODES
from tests import checkpoints as ck
from tests.storage import test_fuzz_headers as headers

CI_MUTATIONS = 2000  # ~1-1.5 min on the 2-core CI machine (definitions built in process); the long run is in README's Reliability section
CASE_TIMEOUT = 20  # seconds: a case that takes longer is a hang (the slowest real case takes ~1 s)
ALLOWED = set(EXIT_CODES) - {1, 130, 141}
CARD = "---\nlicense: apache-2.0\ntags:\n- text\nbase_model: org/base\n---\n# A model\n\nSome text.\n"


# ---------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------

def build_seeds(root: Path) -> dict[str, Path]:
    """The seed folders: sources and finished outputs."""
    from fp4convert.config import ConvertConfig
    from fp4convert.run.convert import convert

    out = {}
    llama = root / "llama"
    ck.llama(llama, hidden=32, layers=1, zoo=True)
    (llama / "README.md").write_text(CARD)
    out["src-llama"] = llama
    fp8 = root / "fp8"
    cfg = ck.llama_config(32, 1)
    t = ck.llama_tensors(cfg)
    w = t["model.layers.0.mlp.down_proj.weight"]
    t["model.layers.0.mlp.down_proj.weight"] = w.float().to(torch.float8_e4m3fn)
    t["model.layers.0.mlp.down_proj.weight_scale_inv"] = torch.ones(1, 1)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    ck.write(fp8, t, cfg)
    out["src-fp8"] = fp8
    for name, fmt, scheme, rotate in (("native", "fp4convert", "nvfp4", None),
                                      ("ct", "compressed-tensors", "mxfp4", "had16"),
                                      ("modelopt", "modelopt", "nvfp4", None)):
        dst = root / name
        convert(llama, dst, ConvertConfig(device="cpu", format=fmt, scheme=scheme, rotate=rotate,
                                          max_shard_size=20000))
        out[f"out-{name}"] = dst
    return out


# ---------------------------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------------------------

_ODD = [None, True, 0, -1, 7, 2 ** 63, 10 ** 30, 1e308, -0.5, "", "x", "re:(", "re:.*", "../../etc/passwd",
        "/etc/passwd", "model.safetensors", [], {}, [1, 2], ["a", "b"], [[16], [16]], [None, None], {"a": 1},
        "a" * 5000, 10 ** 400, "64", ["LlamaForCausalLM", 5], {"language": 9}]

# config.json keys the planner, the model definition, the calibration stage, the formats or the card read
# (fp4convert.source.config_json.KEYS and a few transformers reads), for type confusion (issue 34).
_CONFIG_KEYS = ["architectures", "model_type", "hidden_size", "num_hidden_layers", "num_nextn_predict_layers",
                "tie_word_embeddings", "is_encoder_decoder", "_name_or_path", "torch_dtype", "quantization_config",
                "text_config", "vision_config", "vocab_size", "head_dim", "num_attention_heads", "intermediate_size",
                "num_local_experts", "rope_scaling"]
# Number tokens Python's json reads but no float (or no int64) holds, and NaN/Infinity tokens.
_HUGE = ["9" * 400, "-" + "9" * 400, "1e999", "-1e999", "1e-999", "NaN", "Infinity", "-Infinity", "1" + "0" * 4000]


def _confused(v: object, rnd: random.Random) -> object:
    """``v`` as a value of another JSON type: a number as a string, wrapped in a list or an object, null,
    a boolean, a huge or negative number, a float for an int, deep nesting."""
    deep: object = v
    for _ in range(rnd.choice([3, 30, 70])):
        deep = [deep]
    return rnd.choice([str(v), [v], {"v": v}, None, True, False, 10 ** 400, -1, 0, 3.5, 1e308, deep, "",
                       [[["x"]]], [None], {"a": {"b": [1, {}]}}])


def _confuse_config(obj: dict, rnd: random.Random) -> dict:
    """One config.json key fp4convert or transformers reads given a value of another type (at the top level
    or inside text_config)."""
    target = obj
    if isinstance(obj.get("text_config"), dict) and rnd.random() < 0.3:
        target = obj["text_config"]
    key = rnd.choice(_CONFIG_KEYS)
    target[key] = _confused(target.get(key, 8), rnd)
    return obj


def _huge_number_text(text: str, rnd: random.Random) -> str:
    """One number token of a JSON text replaced by one no float holds (or NaN/Infinity): json.dumps cannot
    write them, so the text is edited."""
    import re

    spots = [m.span() for m in re.finditer(r'(?<![\w".])-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?![\w"])', text)]
    if not spots:
        return text
    a, b = rnd.choice(spots)
    return text[:a] + rnd.choice(_HUGE) + text[b:]


def _odd_value(rnd: random.Random):
    r = rnd.random()
    if r < 0.6:
        return rnd.choice(_ODD)
    if r < 0.9:
        return headers._value(rnd)
    v: object = 1
    for _ in range(rnd.choice([50, 63, 200, 500])):  # deep nesting (deeper: the text-level "[" * 100000)
        v = [v]
    return v


def _paths(obj, prefix=()) -> list[tuple]:
    """Every path (a tuple of keys/indices) into a JSON value, bounded."""
    out = [prefix]
    if len(out) > 2000:
        return out
    if isinstance(obj, dict):
        for k, v in list(obj.items())[:200]:
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:50]):
            out += _paths(v, prefix + (i,))
    return out


def mutate_json(obj, rnd: random.Random):
    """One change anywhere in a JSON value: a value replaced, a key dropped or added, a list emptied."""
    paths = [p for p in _paths(obj) if p]
    if not paths:
        return _odd_value(rnd)
    path = rnd.choice(paths)
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    op = rnd.random()
    if op < 0.65:
        parent[key] = _odd_value(rnd)
    elif op < 0.8:
        del parent[key]
    elif op < 0.9 and isinstance(parent, dict):
        parent[rnd.choice(["quantization_config", "weight_map", "files", "tensors", "ignore", "x"])] = _odd_value(rnd)
    else:
        parent[key] = [parent[key]] * rnd.randrange(0, 3)
    return obj


def _mutate_json_file(p: Path, rnd: random.Random) -> None:
    try:
        obj = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError, OSError, RecursionError):
        obj = None
    if obj is None or rnd.random() < 0.1:  # text-level: truncate, garbage, empty
        raw = p.read_bytes() if p.is_file() else b""
        p.write_bytes(rnd.choice([raw[: rnd.randrange(len(raw) + 1)], b"", b"\xff\xfe", b"[" * 100000,
                                  raw + b"}", b'{"a": NaN}']))
        return
    r = rnd.random()
    if p.name == "config.json" and isinstance(obj, dict) and r < 0.4:
        obj = _confuse_config(obj, rnd)
    else:
        obj = mutate_json(obj, rnd)
    text = json.dumps(obj)
    if rnd.random() < 0.25:
        text = _huge_number_text(text, rnd)
    p.write_text(text)


def _mutate_shard(p: Path, rnd: random.Random) -> None:
    blob = p.read_bytes()
    if rnd.random() < 0.5:
        p.write_bytes(headers.mutate(blob, rnd))
        return
    n = int.from_bytes(blob[:8], "little")
    data = bytearray(blob)
    for _ in range(rnd.randrange(1, 20)):  # data bytes: NaN/Inf patterns, huge values, random
        if len(data) > 8 + n:
            i = rnd.randrange(8 + n, len(data))
            data[i] = rnd.choice([0xFF, 0x7F, 0x80, 0x00, rnd.randrange(256)])
    p.write_bytes(bytes(data))


def _mutate_card(p: Path, rnd: random.Random) -> None:
    if p.is_symlink() or (p.exists() and not p.is_file()):
        return  # an earlier mutation made it special: writing would block on a FIFO
    text = p.read_text() if p.exists() else CARD
    inject = rnd.choice(["tags: 5\n", "base_model: [1, {a: 2}]\n", "license: \"x\\ny\"\n", "---\n", ": :\n",
                         "- - -\n", "base_model: ../../x\n", "\x00", "<script>x</script>\n", "a: *b\n", "{{{\n"])
    lines = text.splitlines(keepends=True)
    lines.insert(rnd.randrange(len(lines) + 1), inject)
    p.write_text("".join(lines))


def _mutate_fs(folder: Path, p: Path, rnd: random.Random, outside: Path) -> None:
    op = rnd.randrange(6)
    if p.is_symlink() or p.exists():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    if op == 0:
        os.mkfifo(p)
    elif op == 1:
        p.mkdir()
    elif op == 2:
        p.symlink_to(outside)
    elif op == 3:
        p.symlink_to("/dev/zero")
    elif op == 4:
        p.symlink_to(p.name)  # a loop
    # op 5: deleted


def mutate_folder(folder: Path, rnd: random.Random, outside: Path) -> str:
    """1-3 mutations of a checkpoint folder in place; returns what was mutated (for the counts)."""
    kinds = []
    for _ in range(rnd.randrange(1, 4)):
        files = sorted(q for q in folder.iterdir() if not q.name.startswith(".fp4convert"))
        shards = [q for q in files if q.name.endswith(".safetensors") and q.is_file() and not q.is_symlink()]
        jsons = [q for q in files if q.name.endswith(".json") and q.is_file() and not q.is_symlink()]
        r = rnd.random()
        if r < 0.3 and shards:
            _mutate_shard(rnd.choice(shards), rnd)
            kinds.append("shard")
        elif r < 0.75 and jsons:
            q = rnd.choice(jsons)
            _mutate_json_file(q, rnd)
            kinds.append(q.name if q.name in ("config.json", "fp4convert.json", "hf_quant_config.json") else "index")
        elif r < 0.85:
            _mutate_card(folder / "README.md", rnd)
            kinds.append("card")
        elif files:
            _mutate_fs(folder, rnd.choice(files), rnd, outside)
            kinds.append("filesystem")
    return "+".join(sorted(set(kinds))) or "none"


# ---------------------------------------------------------------------------------------------
# Running a case
# ---------------------------------------------------------------------------------------------

class Hang(BaseException):
    """A case ran past CASE_TIMEOUT (a BaseException: the CLI's boundary must not swallow it)."""


_timed_out = False  # set by the alarm: the CLI's boundary turns any exception, Hang included, into exit 1


def _alarm(signum, frame):
    global _timed_out
    _timed_out = True
    raise Hang()


def run_case(args: list[str]) -> tuple[int, str]:
    """The CLI in process, with a time limit (SIGALRM interrupts a blocking open or read too)."""
    global _timed_out
    _timed_out = False
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_TIMEOUT)
    try:
        r = CliRunner().invoke(cli, args, catch_exceptions=True)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if _timed_out or isinstance(r.exception, Hang):
        return -1, "hang"
    return r.exit_code, r.output


def problem(code: int, output: str) -> str | None:
    """Why a case's outcome breaks the contract (None: it keeps it)."""
    if code == -1:
        return f"no answer within {CASE_TIMEOUT} s (a hang)"
    if code not in ALLOWED:
        return f"exit {code}: {output.strip().splitlines()[-1][:300] if output.strip() else ''}"
    if "Traceback" in output or "internal error" in output:
        return f"exit {code} with a traceback or an internal error: {output[-300:]}"
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    if len(errors) > 1:
        return f"exit {code} with {len(errors)} error lines"
    if code not in (0, 6) and not errors:
        return f"exit {code} without an 'Error:' line"
    return None


# Every output format and W4A4 (constant scales: no calibration run) for real runs; planning also with
# --input-weights random (it builds the model on meta to check the config: issue 34's type confusion).
_RUN_OPTIONS = [(), ("--format", "compressed-tensors"), ("--format", "modelopt"),
                ("--format", "modelopt", "--activations", "nvfp4", "--activation-scale", "constant")]
_PLAN_OPTIONS = [*_RUN_OPTIONS, ("--input-weights", "random"),
                 ("--format", "compressed-tensors", "--activations", "nvfp4", "--activation-scale", "constant")]


def one_case(seeds: dict[str, Path], work: Path, i: int, rnd: random.Random) -> tuple[str, str, int, str | None]:
    """Mutate a copy of a seed and run the matching command; (seed, what, exit code, problem)."""
    name = rnd.choice(sorted(seeds))
    case = work / f"c{i}"
    folder = case / "in"
    shutil.copytree(seeds[name], folder, symlinks=True)
    outside = case / "outside.txt"
    outside.write_text("outside\n")
    what = mutate_folder(folder, rnd, outside)
    if name.startswith("src-"):
        args = ["quantize", str(folder), str(case / "q"), "--device", "cpu", "-q", "--max-shard-size", "20KB",
                *rnd.choice(_RUN_OPTIONS if i % 8 == 0 else _PLAN_OPTIONS)]
        if i % 8:
            args.append("--dry-run")
        cmd = "quantize" if i % 8 == 0 else "dry-run"
    elif rnd.random() < 0.7:
        args = ["inspect", str(folder)] + (["--check-files"] if i % 3 == 0 else [])
        cmd = "inspect"
    else:
        args = ["export", str(folder), str(case / "x"), "--format", rnd.choice(["compressed-tensors", "modelopt"]),
                "-q"]
        cmd = "export"
    code, output = run_case(args)
    shutil.rmtree(case, ignore_errors=True)
    return f"{name} {cmd}", what, code, problem(code, output)


def fuzz(n: int, seed: int, log=None) -> tuple[collections.Counter, list[str], float]:
    """n cases; (counts of seed/command -> exit codes, the first problems, seconds)."""
    rnd = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    failures: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        seeds = build_seeds(Path(d) / "seeds")
        work = Path(d) / "work"
        work.mkdir()
        for i in range(n):
            where, what, code, why = one_case(seeds, work, i, rnd)
            counts[f"{where}: exit {code}"] += 1
            if why is not None:
                counts["FAILED"] += 1
                if len(failures) < 10:
                    failures.append(f"#{i} {where} ({what}): {why}")
            if log and why is not None:
                log(f"FAILURE #{i} {where} ({what}): {why}")
            if log and (i + 1) % 100 == 0:
                log(f"{i + 1} cases, {time.perf_counter() - t0:.0f} s, {counts['FAILED']} failed")
    return counts, failures, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# Under pytest
# ---------------------------------------------------------------------------------------------

def test_mutated_checkpoints_and_outputs_end_in_documented_codes(monkeypatch) -> None:
    # Model definitions built in this process (tests/checkpoints.py): a planner's child per mutated
    # config.json (a Python start and transformers' imports, 1-2 s each) made this test take ~18 min.
    ck.definitions_in_process(monkeypatch, like_child=True)
    counts, failures, _ = fuzz(CI_MUTATIONS, seed=23)
    assert not failures, "\n".join(failures)
    codes = collections.Counter(k.rsplit(" ", 1)[1] for k in counts if k != "FAILED" for _ in range(counts[k]))
    # The mutator reaches successes, refusals of sources (4) and inspect findings (6).
    assert codes["0"] >= 50 and codes["4"] >= 50 and codes["6"] >= 50, counts


def test_a_hang_is_caught() -> None:
    """The harness's own time limit works: a FIFO read directly blocks until the alarm."""
    with tempfile.TemporaryDirectory() as d:
        fifo = Path(d) / "f"
        os.mkfifo(fifo)
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(1)
        try:
            try:
                fifo.read_bytes()
            except Hang:
                hung = True
            else:
                hung = False
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        assert hung
        assert problem(-1, "") and problem(1, "Error: internal error: x") and problem(2, "a\nTraceback")
        assert problem(4, "Error: a\nError: b") and problem(6, "verdict: FAILED") is None


def test_a_hang_inside_the_cli_is_reported_as_one(monkeypatch) -> None:
    """The CLI's boundary catches every exception (BaseException), the harness's Hang included, and used to
    turn it into 'exit 1: internal error: Hang'; the case must read as a hang."""
    import fp4convert.checkpoint.inspect

    monkeypatch.setattr(sys.modules[__name__], "CASE_TIMEOUT", 1)
    monkeypatch.setattr(fp4convert.checkpoint.inspect, "inspect_checkpoint", lambda *a, **k: time.sleep(30))
    t0 = time.monotonic()
    code, output = run_case(["inspect", "anything"])
    assert (code, output) == (-1, "hang") and time.monotonic() - t0 < 10
    assert problem(code, output).endswith("(a hang)")


# ---------------------------------------------------------------------------------------------
# Script mode
# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutations", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    counts, failures, wall = fuzz(args.mutations, args.seed, log=lambda s: print(s, flush=True))
    print(f"{args.mutations} cases (seed {args.seed}) in {wall:.1f} s ({args.mutations / wall:.0f}/s)")
    for k in sorted(counts):
        print(f"  {k:46s} {counts[k]}")
    for f in failures:
        print("  FAILURE", f)
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
