"""The block-by-block runner: any model transformers builds, one block's weights at a time.

The model and its weights are :class:`~fp4convert.calibrate.weights.BlockWeights` (built on ``meta`` from
config.json, blocks found from the definition, checkpoint tensors read one block at a time). Then:

1. the weights outside the blocks that the forward needs before block 0 (embeddings, rotary tables,
   norms; never the heads nor the towers) are read, and the model's forward runs once per micro-batch
   with recorders in place of the blocks (:func:`~fp4convert.calibrate.capture.block_calls`): each
   block's exact arguments (masks, position embeddings; no cache); those weights are released;
2. for each block: its weights are read from the checkpoint, it runs on every micro-batch (each of its
   calls, on the one before's output, where the forward runs it several times over: ALBERT's shared
   layers), every ``nn.Linear`` / GPT-2 ``Conv1D`` input and every 3-D expert stack's inputs are observed
   (all tokens through every expert for the statistics, the router's choice for the output), a calibrated method
   may quantize the block and load it again (:meth:`LayerwiseModel.blocks`), its outputs become the next
   block's inputs, and its weights go back to ``meta``;
3. the linears outside the blocks (a pooler, a projection, the head's input) are observed by the model's
   forward run once more with stand-ins returning the last block's outputs
   (:func:`~fp4convert.calibrate.tail.tail_pass`), the weights outside the blocks loaded again.

One block's weights are resident at a time: memory does not grow with depth. Everything runs in
fp32 on the given device (the GPU when there is one; matmuls in TF32 there). An architecture this
cannot run (an encoder-decoder, no repeated blocks) is refused by
:func:`~fp4convert.calibrate.model.structure_problem` while planning; one whose forward runs a block again
after a later one (HRM's cycles) when its calls are recorded (or earlier, by
:func:`~fp4convert.calibrate.tail.blind_spots`).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fp4convert import timing
from fp4convert.calibrate.capture import (
    ExpertTap,
    block_calls,
    block_output,
    is_expert_stack,
    repeats,
    replace_hidden,
    run_block,
)
from fp4convert.calibrate.model import reports_device
from fp4convert.calibrate.progress import progress_bar
from fp4convert.calibrate.tail import HEAD, tail_pass
from fp4convert.calibrate.weights import BlockWeights
from fp4convert.errors import PlanError

if TYPE_CHECKING:
    from collections.abc import Callable, Collection

    import torch

    from fp4convert.calibrate.estimate import BlockClock
    from fp4convert.calibrate.resume import Checkpoint
    from fp4convert.calibrate.stats import Observers

log = logging.getLogger(__name__)

MICRO_BATCH = 8  # samples per forward (bounds the intermediates)
CHUNK = 4  # micro-batches whose statistics are summed together before the chunks are added (Observer.parts): the
# unit of calibration samples a torchrun rank owns, so the sums do not depend on how many ranks share the work


@dataclass
class Visit:
    """One block of :meth:`LayerwiseModel.blocks`, observed and still loaded: its index and name prefix."""

    index: int
    prefix: str
    reloaded: bool = False
    tail: bool = False  # the linears outside the blocks (index len(layers), prefix ""): nothing runs after them
    # run the block again on the same inputs, its weights as now loaded, observing only these inputs (GPTQ's
    # true-sequential order: a linear calibrated on the outputs of the block's linears quantized before it);
    # returns the block's outputs (outputs=False: not wanted; a streamed expert stack not observed is then idle)
    again: Callable[..., list] | None = None
    # input name -> the norm module whose output every call of it was (its weight can take a per-channel
    # scale of that input: GPTQ's smoothing); inputs fed by anything else are absent
    fed: dict[str, str] = field(default_factory=dict)
    outputs: list = field(default_factory=list)  # the block's outputs of the run just observed (weights as read)
    # the block's floating-point checkpoint tensors as read (key -> fp32 on the run's device), when the pass asked
    # for them (blocks(keep_reads=True): a calibrated method quantizes them without reading them again)
    reads: dict = field(default_factory=dict)
    # the block's streamed expert stacks (blocks(stream_experts=True)): module path -> ExpertStack, their calls of the
    # observed run recorded (fp4convert.calibrate.experts)
    stacks: dict = field(default_factory=dict)


class LayerwiseModel(BlockWeights):
    """A model built on ``meta`` that runs block by block on calibration tokens (its weights: :class:`BlockWeights`)."""

    def check_tokens(self, tokens: torch.Tensor) -> None:
        """Token ids must be rows of the embedding (an IndexError mid-run, a device assert on CUDA)."""
        name = self.embed_name + ".weight"
        disk = self.disk_of.get(name)
        info = self.infos.get(disk) if disk else None
        top = int(tokens.max()) if tokens.numel() else -1
        if info is not None and info.shape and top >= info.shape[0]:
            raise PlanError(f"{self.root}: token id {top} is not below the {info.shape[0]} rows of {info.name} "
                            "(config.json vocab_size or the tokenizer is larger than the embedding); fix config.json "
                            f"or the tokenizer, {self.other}")

    def _forward(self, ids: torch.Tensor, **kw):
        with reports_device(self.model, self.device):
            return self.model(input_ids=ids, use_cache=False, **kw)

    def capture(self, batches: list[torch.Tensor]) -> list[list[tuple[tuple, dict]]]:
        """Every block's calls per micro-batch (:func:`~fp4convert.calibrate.capture.block_calls`; the forward
        stops at the output heads)."""
        import torch

        def refuse(why: str) -> PlanError:
            return PlanError(f"{self.root}: the layer-by-layer run cannot run this {type(self.model).__name__} "
                             f"(blocks {self.layers_name}): {why}; {self.other}")

        self.load_outside()
        try:
            with torch.no_grad():
                return block_calls(self.model, self.layers, lambda k: self._forward(batches[k]), len(batches),
                                   stop=[self.modules[h] for h in self.heads], refuse=refuse)
        finally:
            self.free_outside()

    def run_layer(self, i: int, args: tuple, kwargs: dict) -> torch.Tensor:
        """Block ``i`` on one recorded call; its hidden-states output."""
        import torch

        with torch.no_grad():
            return block_output(run_block(self.layers[i], i, args, kwargs))

    def observe(self, tokens: torch.Tensor, observers: Observers, head: bool = False,
                micro_batch: int = MICRO_BATCH, progress: bool = True, outside: Collection[str] = (),
                checkpoint: Checkpoint | None = None) -> None:
        """Run the calibration tokens block by block, feeding ``observers`` with every linear's input
        (names: the module's; expert stacks ``{path}:in`` and ``{path}:down:{e}``; ``lm_head``'s input with
        ``head``; the linears outside the blocks named in ``outside``, :mod:`~fp4convert.calibrate.tail`).
        Raises PlanError when a block's output is not finite."""
        for _ in self.blocks(tokens, observers, head=head, micro_batch=micro_batch, progress=progress,
                             outside=outside, checkpoint=checkpoint):
            pass

    def blocks(self, tokens: torch.Tensor, observers: Observers, head: bool = False,
               micro_batch: int = MICRO_BATCH, progress: bool = True, desc: str = "calibrate: blocks",
               outside: Collection[str] = (), keep_reads: bool = False, stream_experts: bool = False,
               checkpoint: Checkpoint | None = None, clock: BlockClock | None = None):
        """:meth:`observe` as a generator: after block ``i`` has run on every micro-batch with its inputs
        observed, it yields a :class:`Visit` while the block's weights are still loaded. The caller may
        quantize them and :meth:`reload_block` the block with the quantized weights (GPTQ's sequential
        pass); the block then runs again, so the next block's inputs are the quantized block's outputs.
        Before that, :attr:`Visit.again` runs the block (as loaded now) on the same inputs observing only
        the inputs named: those of linears after the ones already quantized and reloaded. Last, when
        there is any, the linears outside the blocks (``outside``, the head with ``head``) are observed
        on the last block's outputs (:func:`~fp4convert.calibrate.tail.tail_pass`) and a :class:`Visit`
        with ``tail`` set is yielded. ``keep_reads``: each visit carries the block's checkpoint tensors as read
        (:attr:`Visit.reads`). ``stream_experts``: the block's expert stacks that can run a group of experts at a
        time are streamed (:attr:`Visit.stacks`; their inputs are recorded, not observed). ``checkpoint``: the
        pass starts where an interrupted one stopped (its saved block index and hidden states) and keeps its own
        progress as blocks finish (:class:`~fp4convert.calibrate.resume.PassCheckpoint`). Under torchrun
        (:attr:`group`) this process runs its own chunks of micro-batches only (:func:`share`)."""
        import torch

        self.check_tokens(tokens)
        mine = share(tokens.shape[0], micro_batch, self.group)
        self._chunks = [k // CHUNK for k in mine]
        timing.count("calibrate_micro_batches", len(mine))
        batches = [tokens[k * micro_batch: (k + 1) * micro_batch].to(self.device) for k in mine]
        with timing.timed("calibrate_capture"):
            calls = self.capture(batches)
        reps = repeats(calls, len(batches))
        hs = [self._hidden_of(0, *calls[0][k * reps[0]]) for k in range(len(batches))]
        first = 0
        resumed = checkpoint.start(len(batches)) if checkpoint is not None else None
        if resumed is not None:
            first, hs = resumed
            hs = [h.to(self.device) for h in hs]
            for j in range(first):
                calls[j] = []
            log.info("calibration resumed at block %d of %d (the blocks before it kept)", first, len(self.layers))
        try:
            bar = progress_bar(len(self.layers) - first, desc, progress, tokens_per_unit=int(tokens.numel()))
            never: list[str] = []
            if first:
                self.read_ahead(first)
            if clock is not None:
                clock.start()
            for i, block in enumerate(self.layers):
                if i < first:
                    continue
                prefix = f"{self.layers_name}.{i}."
                with timing.timed("calibrate_load"):
                    reads = self.load_block(i, keep_reads=keep_reads, stream=stream_experts)
                self.read_ahead(i + 1)
                fed: dict[str, str] = {}
                seen: list[dict[str, int]] = []
                outs, taps = self._observed_run(i, block, prefix, calls[i], hs, reps[i], observers, fed, seen)
                # the inputs every micro-batch's block call feeds exactly once: a rerun that wants only these (and
                # not the outputs) stops there (a linear called twice, or an expert not reached, runs to the end)
                once = frozenset(n for n in seen[0] if all(c.get(n) == 1 for c in seen)) \
                    if seen and reps[i] == 1 else frozenset()
                for t in taps:
                    if t.routed is not None:
                        never += [f"{t.name}.{e}" for e in (t.routed == 0).nonzero().flatten().tolist()]

                def again(names: Collection[str], outputs: bool = True, _i=i, _block=block, _prefix=prefix,
                          _hs=hs, _once=once) -> list:
                    observers.only = set(names)
                    idle = [] if outputs else list(self.stacks.get(_i, {}).values())
                    for st in idle:
                        st.idle = True  # (its output is not wanted: nothing observed comes after a block's experts)
                    stop = None if outputs or not names or not set(names) <= _once else frozenset(names)
                    try:
                        return self._observed_run(_i, _block, _prefix, calls[_i], _hs, reps[_i], observers,
                                                  stop=stop)[0]
                    finally:
                        observers.only = None
                        for st in idle:
                            st.idle = False

                visit = Visit(i, prefix, again=again, fed={k: v for k, v in fed.items() if v}, outputs=outs, reads=reads,
                              stacks=self.stacks.get(i, {}))
                yield visit
                if visit.reloaded:
                    outs = self._run_block(i, block, calls[i], hs, reps[i])
                bad = not bool(torch.stack([torch.isfinite(o).all() for o in outs]).all())
                self.free_block(i)
                if bad:
                    raise PlanError(f"{self.root}: block {i} ({prefix[:-1]}) produced NaN/Inf on the calibration input; "
                                    f"no activation statistics can be taken from it: give other calibration data, {self.other}")
                hs = outs
                calls[i] = []  # this block's recorded arguments are not needed again
                if checkpoint is not None:
                    checkpoint.save(i + 1, hs)
                if clock is not None:
                    clock.done(i)
                bar.update(1)
            bar.close()
        finally:
            self.close()  # nothing read ahead outlives the pass (an error included)
        if never:
            log.warning("%d experts were never chosen by the router on the calibration tokens (e.g. %s); their "
                        "statistics come from every token sent through them", len(never), never[0])
        names = set(outside) - {HEAD}
        if names or (head and self.heads):
            with timing.timed("calibrate_tail"), fast_matmul(self.device):
                tail_pass(self, self._forward, batches, names, head, observers, finals=hs, chunks=self._chunks)
            yield Visit(len(self.layers), "", tail=True)

    def _observed_run(self, i: int, block, prefix: str, calls: list, hs: list, reps: int,
                      observers: Observers, fed: dict[str, str] | None = None, seen: list[dict[str, int]] | None = None,
                      stop: frozenset[str] | None = None) -> tuple[list, list]:
        """Block ``i`` on every micro-batch with its linears' (and expert stacks') inputs observed: its
        outputs and the expert taps (their routing counts). ``fed``: filled with each linear input's
        norm (:attr:`Visit.fed`; "" where some call's input was not a norm's output). ``seen``: filled with how
        many times each linear was called, per micro-batch. ``stop``: inputs each micro-batch's call feeds once; the call ends
        as soon as all of them are observed (the rest of the block would compute outputs nobody reads: the
        observed inputs are the same tensors, so the statistics are the same bits; no outputs are returned).
        A streamed expert stack records its calls anew when every input is observed, or its path is among
        those observed alone."""
        import torch
        from transformers.pytorch_utils import Conv1D

        handles = []
        taps = []
        last: list = [None]  # (norm name, its latest output)

        waiting: set[str] = set()

        def linear_in(name: str, x) -> None:
            if fed is not None:
                got = last[0][0] if last[0] is not None and last[0][1] is x else ""
                fed[name] = got if fed.get(name, got) == got else ""
            if seen is not None:
                seen[-1][name] = seen[-1].get(name, 0) + 1
            observers.add(name, x)
            if stop is not None:
                waiting.discard(name)
                if not waiting:
                    raise _Enough

        stacks = {p: st for p, st in self.stacks.get(i, {}).items() if observers.only is None or p in observers.only}
        for st in stacks.values():
            st.recording, st.calls = True, []  # (its inputs recorded: a method takes their statistics by group)
        for n, m in block.named_modules():
            if prefix + n in stacks:
                continue
            if isinstance(m, (torch.nn.Linear, Conv1D)):
                handles.append(m.register_forward_pre_hook(lambda _m, a, _n=prefix + n: linear_in(_n, a[0])))
            elif fed is not None and is_norm(m):
                handles.append(m.register_forward_hook(
                    lambda _m, _a, out, _n=prefix + n: last.__setitem__(0, (_n, out))))
            elif is_expert_stack(m):
                taps.append(ExpertTap(prefix + n, m, observers))
        self._observing = observers
        try:
            before = (lambda: seen.append({})) if seen is not None else None
            if stop is not None:
                before = lambda: waiting.update(stop)  # noqa: E731
            outs = self._run_block(i, block, calls, hs, reps, before=before)
        finally:
            self._observing = None
            for hd in handles:
                hd.remove()
            for t in taps:
                t.remove()
            for st in stacks.values():
                st.recording = False
        return outs, taps

    def _run_block(self, i: int, block, calls: list, hs: list, reps: int = 1, before=None) -> list:
        """Block ``i`` on every micro-batch: its ``reps`` calls per micro-batch in order, each on the one
        before's output (a block the forward runs several times over), the first on ``hs``. ``before``: called
        before each micro-batch; a micro-batch whose call raises :class:`_Enough` (its observer has what it
        wanted) gives no output, and the returned list is empty."""
        import torch

        outs = []
        observers = self._observing
        with timing.timed("calibrate_forward"), fast_matmul(self.device):
            for k in range(len(hs)):
                if observers is not None:
                    observers.chunk = self._chunks[k]
                for st in self.stacks.get(i, {}).values():
                    st.chunk = self._chunks[k]
                if before is not None:
                    before()
                h = hs[k]
                try:
                    for r in range(reps):
                        a, kw = calls[k * reps + r]
                        args, kw = replace_hidden(block, a, kw, h)
                        h = self.run_layer(i, args, kw)
                except _Enough:
                    continue
                outs.append(h)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # (the time above is the GPU's, not the launches')
        return outs

    def reload_block(self, visit: Visit, replaced: dict[str, torch.Tensor]) -> None:
        """Load the visited block again with some checkpoint tensors replaced (``replaced``: key -> the
        tensor in its on-disk shape, e.g. the quantized weights dequantized): through transformers'
        converters, as the checkpoint's own tensors load."""
        self._replaced = replaced
        try:
            self.free_block(visit.index, keep_stacks=True)
            self.load_block(visit.index)
        finally:
            self._replaced = {}
        visit.reloaded = True

    def _load_quietly(self, i: int) -> None:
        """Load block ``i`` from a forward pre-hook (which must return None, or it replaces the arguments)."""
        self.load_block(i)

    def _hidden_of(self, i: int, args: tuple, kwargs: dict):
        from fp4convert.calibrate.capture import hidden_slot

        return args[0] if args else kwargs[hidden_slot(self.layers[i])]

    # -- generation (self-generated samples) ----------------------------------------------------------

    @contextmanager
    def whole(self, resident: bool):
        """The whole model runnable: every weight resident (``resident``), or each block loaded before its
        forward and released after (one block at a time, re-read at every call)."""
        import torch

        handles = []
        tied = set()
        t0 = time.perf_counter()
        self.load_outside()
        self._load_keys([k for h in self.heads for k in self._keys_under(h + ".")])
        for h in self.heads:
            head = self.modules[h]
            w = getattr(head, "weight", None)
            if w is not None and w.device.type == "meta":  # tied to the input embedding
                emb = self.model.get_input_embeddings()
                head.weight = emb.weight
                tied.add(h)
        if resident:
            for i in range(len(self.layers)):
                self.load_block(i)
        else:
            for i, b in enumerate(self.layers):
                handles.append(b.register_forward_pre_hook(lambda _m, _a, _i=i: self._load_quietly(_i)))
                handles.append(b.register_forward_hook(lambda _m, _a, _o, _i=i: self.free_block(_i)))
        timing.add("calibrate_generate_load", time.perf_counter() - t0)
        try:
            with reports_device(self.model, self.device):
                yield self.model
        finally:
            for hd in handles:
                hd.remove()
            for i in range(len(self.layers)):
                self.free_block(i)
            for h in self.heads:
                head = self.modules[h]
                if h in tied:  # the embedding's weight, accounted (and freed) with it
                    w = head.weight
                    head.weight = torch.nn.Parameter(torch.empty(w.shape, device="meta"), requires_grad=False)
                else:
                    self._free_params([(f"{h}.{n}", p) for n, p in head.named_parameters()])
            self.free_outside()


class _Enough(BaseException):
    """Raised from an input's hook when a rerun has observed every input it wanted: the block call ends there (a
    signal, not an error: a BaseException, so no ``except Exception`` in a model's forward swallows it)."""


def share(samples: int, micro_batch: int, group=None) -> list[int]:
    """The micro-batches (of ``samples`` samples, ``micro_batch`` each) this process runs: all of them in one
    process; under torchrun, the chunks of CHUNK micro-batches whose index modulo the ranks is this rank's.
    Refused when some rank would get none (every rank runs every block)."""
    n = -(-samples // micro_batch)
    if group is None or not group.distributed:
        return list(range(n))
    chunks = -(-n // CHUNK)
    if chunks < group.size:
        raise PlanError(f"{samples} calibration samples make {chunks} chunk(s) of {CHUNK * micro_batch} samples, fewer "
                        f"than the {group.size} torchrun ranks (each runs whole chunks); give --calibration-samples "
                        f"{group.size * CHUNK * micro_batch} or more, or run fewer ranks")
    return [k for k in range(n) if (k // CHUNK) % group.size == group.rank]


def is_norm(module) -> bool:
    """A normalization layer with a per-channel weight (RMSNorm, LayerNorm and their kin), no submodules."""
    import torch

    w = getattr(module, "weight", None)
    return ("Norm" in type(module).__name__ and isinstance(w, torch.nn.Parameter) and w.dim() == 1
            and not any(True for _ in module.children()))


@contextmanager
def fast_matmul(device):
    """fp32 matmuls with TF32 on a GPU while the model runs on calibration tokens (8x the strict fp32 rate on
    an H100/H200; the statistics are float sums whose last bits depend on the device anyway, docs/numerics.md
    "GPTQ"); no change on the CPU. GPTQ's own lazy update turns TF32 off again (numerics/gptq.py)."""
    import torch

    if getattr(device, "type", device) != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
