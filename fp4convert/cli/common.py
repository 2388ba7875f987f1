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
            teardown_logging()
            if main_thread:
                signal.signal(signal.SIGTERM, old_term)

    return wrapper


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


# What Ctrl-C (or SIGTERM) means for each command: only the writing ones keep finished shards for --resume.
INTERRUPTED = {
    "quantize": "interrupted; finished shards are kept: run the same command with --resume to continue",
    "export": "interrupted; finished shards are kept: run the same export with --resume to continue",
    "inspect": "interrupted; inspect writes nothing: run it again",
    "push": "interrupted; run the same push again: only what is missing is uploaded",
}


def classify(exc: BaseException, src: str | None, dst: str | None, command: str = "quantize") -> FP4ConvertError:
    """Any exception as the FP4ConvertError the user sees."""
    import errno

    if isinstance(exc, FP4ConvertError):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        return Interrupted(INTERRUPTED.get(command, "interrupted"))
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

