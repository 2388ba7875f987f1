"""What every command shares at run time: the log handler, the rank, and the error boundary (progress is the
library's: :mod:`fp4convert.run.progress`).

Library errors (``FP4ConvertError`` subclasses) become one-line messages with their class's exit code (the
table is ``fp4convert.errors.EXIT_CODES``, printed at the end of ``--help``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from functools import wraps

import click
from tqdm import tqdm

from fp4convert.errors import STDOUT_CLOSED, FP4ConvertError, Interrupted, RankFailed
from fp4convert.storage.names import MANIFEST_NAME

log = logging.getLogger("fp4convert")


class CliHandler(logging.Handler):
    """The command line's one log handler: lines that do not tear the progress bar.

    It sits on the ROOT logger while a command runs and is removed when it ends; the library's own
    ``fp4convert`` logger is never touched (no handler, level or propagation change), so an application
    or a test that embeds the library keeps seeing its records. fp4convert's records pass from
    ``ours``, other libraries' (huggingface_hub, transformers) from ``others``.
    """

    def __init__(self, ours: int, others: int, json_progress: bool = False) -> None:
        super().__init__(logging.NOTSET)
        self.ours, self.others, self.json_progress = ours, others, json_progress
        self.setFormatter(logging.Formatter("%(message)s"))

    def filter(self, record: logging.LogRecord) -> bool:
        mine = record.name == "fp4convert" or record.name.startswith("fp4convert.")
        if mine and getattr(record, "serving", False):
            return False  # the command prints a format's serving warning itself, even with --quiet (warn_serving)
        if mine and self.json_progress and getattr(record, "progress", None) is not None:
            return True  # --json: a long step's progress, as data
        return record.levelno >= (self.ours if mine else self.others)

    def emit(self, record: logging.LogRecord) -> None:
        progress = getattr(record, "progress", None)
        if self.json_progress and progress is not None:
            import json

            tqdm.write(json.dumps({"progress": progress}), file=sys.stderr)  # one JSON object a line on stderr
            return
        tqdm.write(self.format(record), file=sys.stderr)


def warn_serving(fmt: str, rotate: str | None, warnings: list | None = None) -> None:
    """What the output format says a user must know before serving this checkpoint (a had16
    compressed-tensors output loads in transformers without error and computes garbage). That is too
    easy to miss for ``--quiet`` to hide: it goes to stderr in every mode (--quiet included; it is one
    line), and into --json's "warnings"."""
    from fp4convert.formats import get_format

    text = get_format(fmt).serving_warning(rotate)
    if text is None or rank() > 0:
        return
    click.echo(f"warning: {text}", err=True)
    if warnings is not None and text not in warnings:
        warnings.append(text)


_installed: list[tuple[CliHandler, int]] = []  # (handler, the root level before it), while a command runs


def setup_logging(quiet: bool, status: bool = True) -> None:
    """--quiet: errors only (huggingface_hub's bars too); --json: warnings and errors; else status lines.

    Undone by :func:`teardown_logging` when the command ends (``library_errors``)."""
    teardown_logging()
    ours = logging.ERROR if quiet else logging.INFO if status else logging.WARNING
    others = logging.ERROR if quiet else logging.WARNING
    root = logging.getLogger()
    json_progress = not quiet and not status  # --json: the progress of long steps as JSON lines on stderr
    handler = CliHandler(ours, others, json_progress)
    _installed.append((handler, root.level))
    root.addHandler(handler)
    root.setLevel(min(ours, others, logging.INFO if json_progress else ours))
    if quiet or not sys.stderr.isatty():
        from fp4convert.checkpoint.push import disable_hub_progress_bars

        disable_hub_progress_bars()


def teardown_logging() -> None:
    root = logging.getLogger()
    while _installed:
        handler, level = _installed.pop()
        root.removeHandler(handler)
        root.setLevel(level)


def rank() -> int:
    """This process's rank under torchrun (0 otherwise): only rank 0 prints plans and summaries."""
    import os

    return int(os.environ.get("RANK", "0") or 0) if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else 0


def library_errors(fn: Callable) -> Callable:
    """The error boundary: every failure becomes one line on stderr and its exit code (errors.EXIT_CODES);
    ``--debug`` adds the full traceback. OS errors name the file (DST: 5, SRC: 4); anything unexpected
    is an internal error (1)."""

    @click.option("--debug", is_flag=True, help="On an error, also print the full traceback.")
    @wraps(fn)
    def wrapper(*args, debug: bool = False, **kwargs):
        import signal
        import threading

        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread:  # SIGTERM stops a run like Ctrl-C does (kept shards, --resume hint)
            old_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            return fn(*args, **kwargs)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except BaseException as exc:  # noqa: BLE001 - the boundary: classify, one line, exit code
            if isinstance(exc, SystemExit):
                raise
            if isinstance(exc, BrokenPipeError) and exc.filename is None:
                stdout_closed()
            if isinstance(exc, RankFailed) and rank() > 0:  # under torchrun rank 0 names the failing rank
                sys.exit(exc.exit_code)
            err = classify(exc, kwargs.get("src"), kwargs.get("dst"), command=fn.__name__)
            if debug:
                import traceback

                traceback.print_exc(file=sys.stderr)
            click.echo(f"Error: {' '.join(str(err).split())}", err=True)
            sys.exit(err.exit_code)
        finally:
            command_over()
            teardown_logging()
            if main_thread:
                signal.signal(signal.SIGTERM, old_term)

    return wrapper


def command_over() -> None:
    """The program's command has ended (its outputs complete, or its error printed): from here to the exit,
    Ctrl-C is ignored, as there is nothing left to stop but the interpreter's teardown (a Ctrl-C there
    killed the process without a word, exit 130, after a complete run). Only in the program itself
    (:func:`program_started`): a command invoked in-process leaves the caller's handlers alone."""
    import signal
    import threading

    if _program and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def stdout_closed() -> None:
    """Whoever read our stdout stopped (``| head``): not an error. Exit 141 (128 + SIGPIPE, what a shell
    reports for a command a closed pipe stopped) without a message or traceback; stdout is pointed at
    /dev/null first so that the interpreter's final flush cannot complain either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    os._exit(STDOUT_CLOSED) if rank() > 0 else sys.exit(STDOUT_CLOSED)


# What Ctrl-C (or SIGTERM) means for each command that writes nothing.
INTERRUPTED = {
    "inspect": "interrupted; inspect writes nothing: run it again",
    "push": "interrupted; run the same push again: only what is missing is uploaded",
}
_AGAIN = {"quantize": "the same command", "export": "the same export"}


def interrupted_message(command: str, dst: str | None) -> str:
    """What a Ctrl-C (or SIGTERM) left, in words: for the writing commands (quantize, export) what DST holds
    now (read from its progress records and manifest, as ``--resume`` will), so the hint fits it: finished
    shards kept for ``--resume``, a run that finished nothing yet, nothing written at all, a complete output."""
    if command not in _AGAIN:
        return INTERRUPTED.get(command, "interrupted")
    again = _AGAIN[command]
    kept, recorded, complete = _dst_state(dst)
    if kept:
        return f"interrupted; {kept} finished shard(s) kept in {dst}: run {again} with --resume to continue"
    if recorded:
        return f"interrupted before any shard was finished: run {again} with --resume to start it again"
    if complete:
        return (f"interrupted; {dst} holds a complete output (its {MANIFEST_NAME} is there): nothing to resume; "
                f"run {again} again if it was to be replaced")
    return f"interrupted before anything was written to {dst}: run {again} again"


def interrupted_after(dst: str, push_repo: str | None = None) -> str:
    """A Ctrl-C once the conversion had finished (while pushing or printing the summary)."""
    if push_repo:
        return (f"interrupted while pushing to {push_repo}; {dst} is complete: run `fp4convert push {dst} {push_repo}` "
                "to finish the upload (only what is missing is sent)")
    return f"interrupted after the conversion had finished: {dst} is complete"


def _dst_state(dst: str | None) -> tuple[int, bool, bool]:
    """(finished shards an interrupted run's progress records list that are on disk, whether such a record is
    there, whether a finished output's manifest is there) for DST; nothing when DST cannot be read."""
    from pathlib import Path

    from fp4convert.output.record import progress_records, read_record
    from fp4convert.storage.names import SHARD_PATTERN

    if not dst or not os.path.isdir(dst):
        return 0, False, False
    root = Path(dst)
    try:
        paths = progress_records(root)
        shards: set[str] = set()
        for path in paths:
            rec, _ = read_record(path, "progress")
            shards |= {f for f in (rec or {}).get("files", {}) if SHARD_PATTERN.match(f) and (root / f).is_file()}
        return len(shards), bool(paths), os.path.isfile(root / MANIFEST_NAME)
    except Exception:  # noqa: BLE001 - a hint must not hide the interruption itself
        return 0, False, False


_program: list[float] = []  # when this process started (monotonic), set by the program's entry point


def program_started() -> None:
    """Called by the console script: the summary's time then counts from the process's start (Python's
    start-up and the imports included), not from the command's."""
    import time

    from fp4convert.timing import process_age

    _program[:] = [time.monotonic() - (process_age() or 0.0)]


def program_seconds(command_started: float) -> float:
    """The run's whole wall time: since the process started (the program), else since the command did (a
    command invoked in-process, e.g. by a test)."""
    import time

    return time.monotonic() - (_program[0] if _program else command_started)


def classify(exc: BaseException, src: str | None, dst: str | None, command: str = "quantize") -> FP4ConvertError:
    """Any exception as the FP4ConvertError the user sees."""
    import errno

    if isinstance(exc, FP4ConvertError):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        return Interrupted(interrupted_message(command, dst))
    if isinstance(exc, RuntimeError) and str(exc).startswith("Symlink loop from "):  # pathlib.resolve()
        from fp4convert.errors import OutputError, SourceError

        where = str(exc)[len("Symlink loop from "):].strip("'")
        full = os.path.abspath(where)
        if dst and (full + os.sep).startswith(os.path.abspath(dst) + os.sep) or dst and \
                (os.path.abspath(dst) + os.sep).startswith(full + os.sep):
            return OutputError(f"{where}: a symlink loop in the destination path; choose another DST")
        return SourceError(f"{where}: a symlink loop; fix the path")
    if isinstance(exc, OSError):
        from fp4convert.errors import OutputError, SourceError

        name = exc.filename or ""
        what = f"{exc.strerror or exc}" + (f", {errno.errorcode[exc.errno]}" if exc.errno in errno.errorcode else "")
        full = os.path.abspath(name) if name else ""
        if dst and full and (full + os.sep).startswith(os.path.abspath(dst) + os.sep):
            return OutputError(f"{name}: cannot write ({what}); check the destination folder")
        if src and full and (full + os.sep).startswith(os.path.abspath(src) + os.sep):
            return SourceError(f"{name}: cannot read ({what}); check the source files")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return OutputError(f"{name or dst}: {what}; free some space, then run the same command with --resume")
        return FP4ConvertError(f"internal error: {type(exc).__name__}: {name + ': ' if name else ''}{what}; "
                               "please report it (rerun with --debug for the traceback)")
    if isinstance(exc, MemoryError):
        return FP4ConvertError("out of host memory; close other programs or use a machine with more memory "
                               "(rerun with --debug for the traceback)")
    text = " ".join(str(exc).split())[:300]
    return FP4ConvertError(f"internal error: {type(exc).__name__}: {text}; please report it "
                           "(rerun with --debug for the traceback)")


# -- options several commands share: each declared once (sqlite-utils' cli.py keeps them the same way) --

