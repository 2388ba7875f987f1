"""The finish: the source's other files, the format's files, the index, the model card, the manifest last.

Runs once every shard is written and the parts' records are merged into the one progress record.
Every file this writes is named in that record first (``pending``), so an interrupted finish leaves
only files ``--resume`` and ``--overwrite`` know as ours; the manifest is written last (its presence
means "finished") and the progress record removed after it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert import timing
from fp4convert.errors import FP4ConvertError, OutputError, SourceError
from fp4convert.output.files import atomic_write, open_new, output_error, rename_in, source_error, step, unlink_in, write_new, writing
from fp4convert.output.manifest import build_manifest, manifest_text
from fp4convert.output.record import save_progress
from fp4convert.storage.names import CONFIG_NAME, FORMAT_FILES, INDEX_NAME, MANIFEST_NAME, PARTIAL, PROGRESS_NAME

if TYPE_CHECKING:
    from fp4convert.formats.base import OutputFormat
    from fp4convert.output.destination import Session
    from fp4convert.plan.planner import Plan
    from fp4convert.source.source import Source

MAX_MANIFEST = 1 << 30  # bytes; a source "manifest" larger than this is not read
_COPY_CHUNK = 16 << 20


def finish(source: Source, plan: Plan, fmt: OutputFormat, dst: Path, identity: dict, others: list[Path],
           session: Session | None, calibration: dict | None = None, method: dict | None = None) -> None:
    """Other files, the index, then the manifest (last: its presence means 'finished'); releases DST.
    ``calibration``: W4A4 NVFP4, how the activation scales were calibrated; ``method``: ``--method gptq``,
    what its pass did (the manifest and the card record both)."""
    from fp4convert.output.destination import planned_names

    try:
        with timing.timed("finish"):
            _finish(source, plan, fmt, dst, identity, others, calibration, method)
    except BaseException as exc:
        for name in planned_names(plan, source, others) - {f for f, _ in plan.shards}:  # only our own temporary files
            try:
                unlink_in(dst, name + PARTIAL)
            except (OSError, OutputError):
                pass
        if session is not None:
            session.fail()
        if isinstance(exc, OSError) and not isinstance(exc, FP4ConvertError):
            raise output_error(exc, exc.filename or dst) from exc
        raise
    if session is not None:
        session.release()


def _finish(source: Source, plan: Plan, fmt: OutputFormat, dst: Path, identity: dict, others: list[Path],
            calibration: dict | None, method: dict | None = None) -> None:
    state = json.loads((dst / PROGRESS_NAME).read_text())
    rels = [p.relative_to(source.root).as_posix() for p in others]
    # Name every file finish writes in the record first: --overwrite then knows they are ours.
    state["pending"] = sorted({*state.get("pending", []), INDEX_NAME, *rels, *FORMAT_FILES})
    save_progress(dst, state)
    written = [INDEX_NAME]
    for p, rel in zip(others, rels):
        written.append(rel)
        _copy_file(p, dst / (rel + PARTIAL), source, dst)
        rename_in(dst, rel + PARTIAL, rel)
        step()
    # The format's files are written by path (formats.base.write_json): no symlink may stand where it
    # writes or reads (config.json is a regular file once copied; the temporary names are ours).
    for name in FORMAT_FILES:
        unlink_in(dst, name + PARTIAL)
        if os.path.islink(dst / name):
            unlink_in(dst, name)
    with writing(dst):
        _kept_dtype_config(dst, plan)
        written += fmt.finalize(dst, plan.output_info(source.config()))
    shard_of = plan.shard_of()
    total = sum(e.nbytes for _, entries in plan.shards for e in entries)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(shard_of.items()))}
    with writing(dst / INDEX_NAME):
        atomic_write(dst / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    step()
    with writing(dst / MANIFEST_NAME):
        written = _write_model_card(source, plan, fmt, dst, identity, state, written, calibration, method)
        manifest = build_manifest(plan, fmt, source, identity, state, dst, written, calibration, method)
        atomic_write(dst / MANIFEST_NAME, manifest_text(manifest))
    step()
    with writing(dst / PROGRESS_NAME):
        (dst / PROGRESS_NAME).unlink()


def _kept_dtype_config(dst: Path, plan: Plan) -> None:
    """``--kept-dtype bf16``: config.json's ``dtype`` / ``torch_dtype`` says float32 or float64 no more, as
    the kept tensors it described are BF16 now (``from_pretrained(dtype="auto")`` would upcast them
    again). Before the format's own changes (compressed-tensors writes bfloat16 in any case)."""
    from fp4convert.formats.base import read_json, update_config

    if getattr(plan.config, "kept_dtype", "source") != "bf16" or not (dst / CONFIG_NAME).is_file():
        return
    cfg = read_json(dst / CONFIG_NAME)
    for key in ("dtype", "torch_dtype"):
        if cfg.get(key) in ("float32", "float64"):
            update_config(dst, key, "bfloat16")


def _write_model_card(source: Source, plan: Plan, fmt: OutputFormat, dst: Path, identity: dict, state: dict,
                      written: list[str], calibration: dict | None, method: dict | None = None) -> list[str]:
    """README.md: the generated card (from what the manifest will say) above the source's own card.

    The source card is read contained (:meth:`Source.read_card`); it counts as our own earlier card
    (exporting a native output) only when the source's manifest lists its sha256."""
    from fp4convert.output.card import build_card, default_base_model, own_card, split_card
    from fp4convert.storage.names import CARD_NAME

    text = source.read_card()
    src_manifest = _source_manifest(source)
    ours = bool(text and src_manifest is not None and own_card(text, src_manifest))
    origin = src_manifest.get("source") if ours and src_manifest and isinstance(src_manifest.get("source"), dict) \
        else None
    draft = build_manifest(plan, fmt, source, identity, state, dst, [w for w in written if w != CARD_NAME], calibration,
                           method)
    config = source.config()
    base = getattr(plan.config, "base_model", None) or default_base_model(
        origin or source.describe(), source.root, config, split_card(text)[0] if ours and text else None)
    write_new(dst, CARD_NAME, build_card(draft, text, base_model=base, config=config, original_is_ours=ours,
                                         origin=origin).encode())
    return written if CARD_NAME in written else [*written, CARD_NAME]


def _source_manifest(source: Source) -> dict | None:
    """The source's fp4convert manifest (exporting a native output), read contained; None if absent or unreadable."""
    if not os.path.lexists(source.root / MANIFEST_NAME):
        return None
    try:
        fd = source.open_file(MANIFEST_NAME, "the manifest")
    except SourceError:
        return None
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(MAX_MANIFEST + 1)
    try:
        m = json.loads(data) if len(data) <= MAX_MANIFEST else None
    except (ValueError, RecursionError):
        return None
    return m if isinstance(m, dict) else None


def _copy_file(src: Path, target: Path, source: Source, dst: Path) -> None:
    """Copy a whole file of the source to ``target`` (a ``.partial`` name inside DST), telling a read error
    (the source's) from a write error (the destination's). Both ends are contained: the source file is
    opened through :meth:`Source.open_file` (never outside SRC), the target with :func:`open_new`."""
    fd = source.open_file(src.relative_to(source.root).as_posix(), "file")
    with os.fdopen(fd, "rb") as fin:
        out = open_new(dst, target.relative_to(dst).as_posix())
        with writing(target):
            fout = os.fdopen(out, "wb")
        with fout:
            while True:
                try:
                    block = fin.read(_COPY_CHUNK)
                except OSError as exc:
                    raise source_error(exc, src) from exc
                if not block:
                    break
                with writing(target):
                    fout.write(block)
            with writing(target):
                fout.flush()
