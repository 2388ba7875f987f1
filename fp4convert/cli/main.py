"""The ``fp4convert`` program: the command group, one command per module of this package.

``entry`` is the console script (and ``python -m fp4convert``); each command parses its options into a
frozen config and calls the library.
"""

from __future__ import annotations

import os
import sys

import click

from fp4convert.cli.common import command_over, program_started
from fp4convert.cli.export import export
from fp4convert.cli.inspect import inspect
from fp4convert.cli.options import EXIT_CODE_HELP
from fp4convert.cli.push import push
from fp4convert.cli.quantize import quantize
from fp4convert.version import __version__


def entry() -> None:
    """The ``fp4convert`` program (console script and ``python -m fp4convert``): :func:`main`, then exit.

    A process that ran the torch-free CUDA path exits without the interpreter's teardown (``os._exit``
    once stdout, stderr and the logs are flushed): tearing down the CUDA context and the pinned pool's
    mappings costs ~0.25 s on the H100 machine, 10% of converting a 3 GB MoE, for nothing, since the
    kernel reclaims both and every output file is closed and synced by then. Anything else (torch loaded,
    torchrun) exits normally: torch and torch.distributed register exit handlers.

    Once the command has ended, Ctrl-C is ignored (``common.command_over``): what is left is the
    interpreter's teardown (torch's takes up to a second), which restores the default handlers as it goes,
    so a Ctrl-C there killed the process silently (exit 130 after a complete run) or printed a teardown
    traceback."""
    quiet_openmp()
    program_started()
    try:
        main(prog_name="fp4convert")
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    command_over()
    if isinstance(code, int) and "fp4convert.kernels.cuda.runtime" in sys.modules and "torch" not in sys.modules \
            and not int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        import logging

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def quiet_openmp() -> None:
    """OpenMP threads that sleep at a barrier instead of spinning (``OMP_WAIT_POLICY=PASSIVE`` unless the
    environment sets a policy), before torch loads its OpenMP runtime (which reads it once).

    torch's CPU operations run on OpenMP threads that spin after each parallel region by default. On a
    machine whose cores other work also uses (shared, or more threads than cores), a spinning thread
    holds the core its partner needs, so every small operation waits for a scheduler slice: on the
    2-core machine under a load of 8, a 1536 x 448 matmul took 78 ms instead of 6 ms, a cholesky_inverse
    of 1536 x 1536 13.5 s instead of 0.35 s, and GPTQ of SmolLM2-135M 920 s instead of 360 s
    (BENCHMARKS.md, issue 45). The thread count, and so every result, is the same either way."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODE_HELP)
@click.version_option(__version__, prog_name="fp4convert")
def main() -> None:
    """Convert Hugging Face safetensors checkpoints to NVFP4 / MXFP4 weights.

    \b
      fp4convert quantize MODEL_DIR_OR_REPO OUT_DIR     convert a checkpoint
      fp4convert quantize MODEL OUT --dry-run           show the plan, write nothing
      fp4convert inspect CHECKPOINT                     summarize and check a converted checkpoint
      fp4convert export NATIVE_DIR OUT --format compressed-tensors   re-layout for an engine
    """


for _command in (quantize, inspect, export, push):
    main.add_command(_command)
