"""Calibration input: a text file, seeded random token ids, or samples the model writes itself.

A calibration file is checked before any model runs (one ``Error:`` line naming the file and what
to do, nothing written): empty, binary (NUL bytes), not UTF-8, JSON lines without a string ``text``,
or fewer tokens than the samples asked for.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.errors import PlanError

if TYPE_CHECKING:
    import torch

    from fp4convert.calibrate.layerwise import LayerwiseModel

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json")
# Self-generated samples keep every weight resident when they fit in this share of the device's free
# memory (fp32); beyond it each token step re-reads every block (one block resident at a time):
# seq_len passes over the weights.
RESIDENT_SHARE = 0.5


def resident_budget(device) -> int:
    """Bytes of weights self-generation may keep resident on ``device``: half its free memory."""
    import os

    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free * RESIDENT_SHARE)
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        free = 8 << 30
    return int(free * RESIDENT_SHARE)


def read_texts(path: Path) -> list[str]:
    """A calibration file: JSON lines with a ``text`` field, or plain text (one document).

    It is JSON lines when most of its non-empty lines start with ``{``; then every line must be a JSON
    object with a string ``text`` (the broken ones are named by their line numbers in the file: a
    JSON-lines file with a few damaged lines is refused, not read as plain text full of JSON syntax).
    Only a regular file is read (a FIFO, a device or a folder is named as such; a pipe's data can be
    read only once, and the run reads the file more than once)."""
    path = Path(path)
    data = _regular_bytes(path)
    if not data.strip():
        raise PlanError(f"--calibration-data {path}: the file is empty; give a text or JSON-lines file")
    nul = data.find(bytes(1))
    if nul >= 0:
        raise PlanError(f"--calibration-data {path}: a binary file (NUL byte at offset {nul}); give a "
                        "UTF-8 text or JSON-lines file")
    try:
        raw = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError(f"--calibration-data {path}: not UTF-8 (byte {exc.start}: {exc.reason}); convert it to UTF-8 "
                        "text") from None
    lines = [(n, ln) for n, ln in enumerate(raw.splitlines(), 1) if ln.strip()]
    if 2 * sum(ln.lstrip().startswith("{") for _, ln in lines) <= len(lines):
        return [raw]
    texts, broken = [], []
    for n, ln in lines:
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as exc:
            broken.append((n, f"not a JSON line ({exc.msg})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            broken.append((n, "no string 'text' field"))
            continue
        texts.append(obj["text"])
    if broken:
        named = "; ".join(f"line {n}: {why}" for n, why in broken[:5]) + (
            f"; and {len(broken) - 5} more" if len(broken) > 5 else "")
        raise PlanError(f"--calibration-data {path}: {len(broken)} of its {len(lines)} JSON lines are broken ({named}); "
                        "fix or remove them (each line a JSON object with a string 'text' field), or give plain text")
    if not any(t.strip() for t in texts):
        raise PlanError(f"--calibration-data {path}: every JSON line's 'text' is empty; give calibration text")
    return texts


def _regular_bytes(path: Path) -> bytes:
    """The file's bytes, refusing what is not a regular file by what it is (never blocking on a FIFO)."""
    from fp4convert.storage.reads import NotRegularFile, open_regular

    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise PlanError(f"--calibration-data {path}: no such file") from None
    except NotRegularFile as exc:
        kind = (exc.strerror or "").split(",")[0] or "not a regular file"
        raise PlanError(f"--calibration-data {path}: {kind}, not a regular file; give a text or JSON-lines file "
                        "(the data is read more than once: save a pipe's output to a file first)") from None
    except OSError as exc:
        raise PlanError(f"--calibration-data {path}: cannot read it ({exc.strerror or exc})") from None
    with open(fd, "rb") as f:
        return f.read()


def tokenizer_digest(root: Path) -> str:
    """sha256 over the tokenizer files present (name and bytes, sorted by name)."""
    h = hashlib.sha256()
    for name in sorted(TOKENIZER_FILES):
        p = Path(root) / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def file_tokens(tokenizer, path: Path, samples: int, seq_len: int) -> torch.Tensor:
    """``[samples, seq_len]`` consecutive token windows of the file's documents (joined by blank lines);
    a file holding fewer tokens than that is refused (the run would calibrate on less than asked)."""
    import torch

    ids = tokenizer("\n\n".join(read_texts(path)), add_special_tokens=False)["input_ids"]
    n = len(ids) // seq_len
    if n < samples:
        raise PlanError(f"--calibration-data {path}: {len(ids)} tokens, {n} samples of {seq_len}, fewer than the "
                        f"{samples} asked (--calibration-samples); give more text or ask for --calibration-samples "
                        f"{max(n, 1)}" + (" / a shorter --calibration-seq-len" if n < 1 else ""))
    return torch.tensor(ids[: samples * seq_len], dtype=torch.long).reshape(samples, seq_len)


def start_token(tokenizer) -> int:
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id):
        if tid is not None:
            return int(tid)
    raise PlanError("the tokenizer has no BOS/EOS/PAD token to start self-generated samples; give --calibration-data")


def random_tokens(vocab_size: int, samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``[samples, seq_len]`` uniformly random token ids in [0, vocab_size), from a seeded CPU generator.

    Data-free input statistics for the weight scale rules' ``input_weight``: on SmolLM2-135M the
    per-channel mean squares of linear inputs on 16 x 256 random ids gave NVFP4 ``mse`` 0.586x
    llm-compressor's KL, against 0.544x with a calibration text (BENCHMARKS.md). No generation pass:
    the massive-activation channels and norm gains that dominate these statistics do not depend on
    the text. The same seed gives the same ids on every machine (torch's CPU generator).
    """
    import torch

    if vocab_size < 1 or samples < 1 or seq_len < 1:
        raise PlanError(f"random calibration tokens need a vocabulary and a shape, got {vocab_size}, {samples}x{seq_len}")
    return torch.randint(0, vocab_size, (samples, seq_len), generator=torch.Generator().manual_seed(seed))


def generate(lm: LayerwiseModel, tokenizer, samples: int, seq_len: int, seed: int,
             resident_bytes: int | None = None) -> torch.Tensor:
    """``[samples, seq_len]`` tokens the model samples itself from its start token: the model's own
    forward with its own KV cache, every sample at once, one token per step (TF32 matmuls on a GPU,
    as the calibration pass runs; on a GPU with resident weights the steps are replays of one CUDA
    graph where it reproduces the eager steps bit for bit, :mod:`~fp4convert.calibrate.decode`). The
    next token is drawn on the run's device from a generator seeded with ``seed``: the same seed gives
    the same samples run to run on one device (the logits' last bits differ between devices anyway);
    on a GPU nothing but the token ids crosses to the host per step.

    The weights stay resident when they fit in ``resident_bytes`` (fp32; default: half the device's
    free memory); otherwise each step reads every block again, one at a time (``seq_len`` passes over
    the checkpoint: the run says so).
    """
    import torch

    from fp4convert.calibrate.decode import graphed_steps
    from fp4convert.calibrate.layerwise import fast_matmul
    from fp4convert.calibrate.progress import progress_bar

    gen = torch.Generator(lm.device).manual_seed(seed)
    tokens = torch.full((samples, 1), start_token(tokenizer), dtype=torch.long, device=lm.device)
    vocab = len(tokenizer)
    total = lm.total_bytes()
    if resident_bytes is None:
        resident_bytes = resident_budget(lm.device)
    resident = total <= resident_bytes
    if not resident:
        log.warning("self-generated calibration samples: the model's %.1f GB (fp32) do not fit the %.1f GB kept "
                    "resident, so each of the %d token steps reads every block again (%.0f GB read); give "
                    "--calibration-data, or fewer/shorter samples (--calibration-samples, --calibration-seq-len)",
                    total / 1e9, resident_bytes / 1e9, seq_len - 1, total / 2 * (seq_len - 1) / 1e9)
    t0 = time.perf_counter()
    bar = progress_bar(samples * (seq_len - 1), f"calibrate: generating {samples} samples x {seq_len} tokens", True,
                       unit="token", tokens_per_unit=1)
    cache = None
    first = None  # when the first step ended (it pays the start-up; the estimate times the steps after it)
    with lm.whole(resident) as model, torch.no_grad(), fast_matmul(lm.device):
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        graphed = graphed_steps(model, samples, seq_len, lm.device, vocab, key, capture=resident)
        for step in range(1, seq_len):
            logits = None
            if graphed is not None:
                try:
                    logits = graphed.step(tokens[:, -1:], step - 1)
                except Exception as exc:  # noqa: BLE001 (no static cache for this model: the eager loop below)
                    if step > 1:
                        raise
                    log.debug("self-generation runs on the model's own cache: %s", exc)
                    graphed = None
            if logits is None:
                ids = tokens[:, -1:] if cache is not None else tokens
                out = model(input_ids=ids, use_cache=True, **{key: cache})
                cache = getattr(out, "past_key_values", None) if getattr(out, "cache", None) is None else out.cache
                logits = out.logits[:, -1, :vocab].float()
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
            tokens = torch.cat([tokens, nxt], dim=1)
            bar.update(samples)
            if first is None:
                first = _synced(lm.device)
            elif step == ESTIMATE_STEPS + 1 and seq_len - 1 > step:
                tell_cost((_synced(lm.device) - first) / ESTIMATE_STEPS, samples, seq_len, lm.device, block_share(lm))
    tokens = tokens.cpu()
    bar.close()
    log.info("self-generated %d x %d calibration tokens in %.1f s%s", samples, seq_len, time.perf_counter() - t0,
             " (steps replayed as a CUDA graph)" if graphed is not None and graphed.graphed else "")
    return tokens


def _synced(device) -> float:
    """The time once the device has finished what was queued (a step's time is the GPU's, not its launches')."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


SLOW_SECONDS = 120.0  # a run projected longer than this says so as a warning, with a smaller setting's cost
ESTIMATE_STEPS = 4  # token steps timed (after the first) for the up-front estimate


def block_share(lm: LayerwiseModel) -> float:
    """The share of the model's weights inside its repeated blocks: the calibration pass runs those
    (no output head), a generation step runs all of them."""
    import math

    total = lm.total_bytes()
    inside = sum(4 * math.prod(int(d) for d in lm.infos[k].shape) for k, (t, _) in lm.keymap.items()
                 if t.startswith(lm.layers_name + "."))
    return inside / total if total else 1.0


def cost(per_step: float, samples: int, seq_len: int, measured_samples: int, share: float) -> tuple[float, float]:
    """(seconds to generate, at most seconds for the calibration pass) of a self-generated calibration
    of ``samples x seq_len`` tokens: ``seq_len - 1`` steps of ``per_step`` seconds as measured with
    ``measured_samples`` per step (a step's matmuls grow with the samples it carries; fewer samples than
    measured is a little dearer per sample than this says), then the same tokens through the blocks
    (``share`` of the weights), at most a step's time per token: its matmuls are larger (a sample's
    tokens at once), about 3x faster per token than the steps on a 2-core CPU (BENCHMARKS.md)."""
    generate = per_step * samples / measured_samples * (seq_len - 1)
    return generate, generate * share


def smaller(samples: int, seq_len: int) -> tuple[int, int]:
    """The setting offered when self-generation is slow: half the samples, half the length (a quarter
    of the tokens: coarser statistics)."""
    return max(1, samples // 2), max(2, seq_len // 2)


def tell_cost(per_step: float, samples: int, seq_len: int, device, share: float) -> None:
    """After the first steps: what the self-generated calibration will cost (from the measured step
    time), and, when that is long, what a smaller setting costs and that a calibration file needs no
    generation."""
    import torch

    gen, run = cost(per_step, samples, seq_len, samples, share)
    rate = samples / per_step if per_step > 0 else float("inf")
    text = (f"self-generated calibration ({samples} samples x {seq_len} tokens on {torch.device(device).type}, "
            f"{rate:.0f} tokens/s measured): about {_minutes(gen)} to generate them, then at most {_minutes(run)} "
            "to run them through the blocks")
    small = smaller(samples, seq_len)
    if gen + run < SLOW_SECONDS or small == (samples, seq_len):
        log.info("%s", text)
        return
    sgen, srun = cost(per_step, *small, samples, share)
    log.warning("%s; --calibration-samples %d --calibration-seq-len %d takes about %s and at most %s; a "
                "--calibration-data file needs no generation", text, small[0], small[1], _minutes(sgen),
                _minutes(srun))


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
