"""The ``cuda`` backend: the GPU without torch, plain 2-D weights from pinned buffers through the kernels.

A conversion whose quantized tensors are all whole 2-D bf16/fp16/fp32 matrices (the usual
checkpoint) runs here, on :mod:`fp4convert.kernels.cuda.runtime` and the kernel library alone, when it is
one process and the device is CUDA. It never imports torch, whose import alone took 4 s on the H100
machine, as long as `cp -r` of a 5.6 GB checkpoint. Everything else (stacked experts, FP8 / MXFP4
inputs, torchrun) runs on the ``stacked`` backend; the bytes are the same either way
(tests/quantizer/test_backend_cuda.py compares them on the GPU).

Per batch (the reader filled one pinned buffer with its members, each shape group back to back),
on one stream: one host-to-device copy of the whole buffer; pass 1 (amax of every matrix, one
launch per shape group); one host sync, after which the reader may refill the buffer and the host
takes each unit's amax (the max over a fused group); pass 2 (quantize with the unit's amax, one
launch per shape group; the kernel computes gs); one device-to-host copy of every output, gs and
flag into a pooled pinned buffer, and an event the writer thread waits for.
"""

from __future__ import annotations

from array import array
from typing import ClassVar, cast

from fp4convert import timing
from fp4convert.kernels.cuda.runtime import D2H, H2D, DeviceArena, HostBuffer, Runtime, align
from fp4convert.numerics.swizzle import padded_shape
from fp4convert.plan.types import QUANTIZE
from fp4convert.quantizer.backend import (
    Context,
    Event,
    Inputs,
    InputWeight,
    MatrixOut,
    Pending,
    Result,
    Settings,
    Staged,
    matrix_weights,
    two_passes,
    weight_runs,
)
from fp4convert.quantizer.items import Batch, is_plain

DTYPE_CODES = {"F32": 0, "F16": 1, "BF16": 2}  # the launchers' dtype ints
FMT_CODES = {"nvfp4": 0, "mxfp4": 1}


class CudaBackend:
    """The batches' two passes on one stream, with device arenas reused from batch to batch."""

    name: ClassVar[str] = "cuda"
    # Smaller batches than the stacked backend's (256 MB): pinned memory costs ~0.8 s per GB to allocate
    # on the H100 machine and the GPU's share of a batch is a few milliseconds, so two 64 MB sets suffice.
    batch_units: ClassVar[int] = 128
    batch_bytes: ClassVar[int] = 64 << 20
    auto_lanes: ClassVar[int] = 2  # several shards written side by side (fp4convert.run.runner)

    def __init__(self, settings: Settings, rt: Runtime, owner: bool) -> None:
        self.s, self.rt, self.owner = settings, rt, owner
        self.dev_in, self.dev_out, self.dev_small = DeviceArena(rt), DeviceArena(rt), DeviceArena(rt)

    @classmethod
    def supports(cls, plan) -> bool:
        """Every quantized unit is plain 2-D bf16/fp16/fp32 weights (no stacked experts, nothing to decode)."""
        for unit in plan.units():
            if unit[0].decode is not None:
                return False
            if unit[0].action == QUANTIZE and not (is_plain(unit) and all(d.info.dtype in DTYPE_CODES for d in unit)):
                return False
        return True

    @classmethod
    def open(cls, ctx: Context) -> CudaBackend:
        index = int(ctx.device.split(":", 1)[1]) if ":" in ctx.device else 0
        return cls(ctx.settings, Runtime(index), owner=True)  # no driver or GPU, an old GPU: CUDAUnavailableError

    def lane(self) -> CudaBackend:
        """Another lane: its own stream and device arenas; one library, one pinned pool."""
        return CudaBackend(self.s, self.rt.lane(), owner=False)

    def thread_init(self) -> None:
        self.rt.set_device()

    def host_buffer(self, nbytes: int) -> HostBuffer:
        return self.rt.pool.get(nbytes)

    def nonfinite(self, dtype: str, data: memoryview) -> bool:
        return self.rt.host_check(dtype, data)

    def close(self) -> None:
        for a in (self.dev_in, self.dev_out, self.dev_small):
            a.free()
        self.rt.close()  # a lane's closes its stream; the first lane's also the pinned pool

    def stage(self, item: Batch, inputs: Inputs) -> Staged:
        """The input copy is queued by :meth:`quantize`, on the one stream: the buffer is in use until
        pass 1's sync (NVFP4) or the batch's event (MXFP4), which the Pending gives."""
        return Staged(item, inputs)

    def quantize(self, staged: Staged) -> Pending:
        """``staged.inputs``: (pinned buffer, [(offset, info)]) from the reader, each shape group's members
        back to back (:func:`~fp4convert.quantizer.items.grouped_offsets`). Returns once pass 2 is queued:
        NVFP4 after pass 1's sync, so the input copy is complete and the inputs are free now; MXFP4 (no
        pass 1) with the batch's event, after which they are."""
        item, inputs = staged.item, staged.inputs
        assert isinstance(item, Batch)
        rt, lib, st, s = self.rt, self.rt.lib, self.rt.stream, self.s
        items = inputs[1]
        buf = cast(HostBuffer, inputs[0])  # from host_buffer(): pinned by the runtime (has .ptr)
        n = len(item.members)
        total = max(off + info.nbytes for off, info in items)
        din = self.dev_in.at_least(total)
        rt.copy(din, buf.ptr, total, H2D)
        nvfp4 = s.scheme.global_scale
        rotate = int(s.rotate == "had16")
        rule = s.scheme.rule(s.rule).code  # the launchers' rule code
        # One launch per shape group (all experts' gate/up of a batch, say): its inputs are one
        # [B, M, K] array in the buffer. Per-matrix values (amax, unit amax, gs, flags) sit in group
        # order: member i at slot pos[i]. Outputs, in one device arena copied back at once: each group's
        # packed codes [B, M, K/2], then its scales [B, rows, cols], at aligned offsets; then gs and
        # the flags of every matrix.
        order = [i for g in item.groups for i in g]
        pos, layout, launches, size = output_layout(item, items, s)
        tail = size
        size += 8 * n
        # Input weights (fp32 [K] each, once per key) after the amax slots; a launch takes one weight,
        # so pass 2 cuts a shape group into runs of members with the same one (backend.weight_runs).
        weights = matrix_weights(item)
        iw_off, small_n = _weight_slots(weights, align(8 * n))
        small = self.dev_small.at_least(small_n)  # pass 1's amax, pass 2's (unit) amax, the input weights
        d_amax, d_ga = small, small + 4 * n

        def amax_pass() -> list[float]:
            for g, off, info, m, k, _, _ in launches:
                rt.check(lib.fp4c_amax(din + off, DTYPE_CODES[info.dtype], rotate, len(g), m * k, d_amax + 4 * pos[g[0]],
                                       st), f"the amax pass on {item.members[g[0]].name}")
            back = rt.pool.get(4 * n)
            rt.copy(back.ptr, d_amax, 4 * n, D2H)
            with timing.timed("quantize_waits_gpu"):
                rt.sync()  # the batch's one sync before pass 2: the unit's amax is taken on the host
            # the input copy is complete: the reader may refill the buffer (the Pending says so: inputs_free None)
            slots = array("f", bytes(back.view(0, 4 * n)))
            return [slots[pos[i]] for i in range(n)]

        def quantize_pass(ga: list[float] | None) -> Pending:
            dout = self.dev_out.at_least(size)
            d_gs, d_flag = dout + tail, dout + tail + 4 * n
            keep: list = []  # pinned buffers an asynchronous copy still reads or writes
            if ga is not None:
                up = rt.pool.get(4 * n)
                up.view(0, 4 * n)[:] = array("f", [ga[i] for i in order]).tobytes()
                rt.copy(d_ga, up.ptr, 4 * n, H2D)
                keep.append(up)
            if iw_off:
                keep.append(_upload_weights(rt, weights, iw_off, small, small_n))
            rt.memset(d_flag, 0, 4 * n)  # the launches only set flags
            for g, off, info, m, k, p_off, s_off in launches:
                x_n = info.nbytes
                p_n, s_n = layout[g[0]][1], layout[g[0]][3]
                for j0, j1, w in weight_runs(g, weights):
                    slot = 4 * (pos[g[0]] + j0)
                    rt.check(lib.fp4c_quantize_iw(din + off + j0 * x_n, DTYPE_CODES[info.dtype], FMT_CODES[s.scheme.name],
                                                  rotate, int(s.swizzle), rule, j1 - j0, m, k,
                                                  d_ga + slot if nvfp4 else None, d_gs + slot if nvfp4 else None,
                                                  dout + p_off + j0 * p_n, dout + s_off + j0 * s_n, d_flag + slot,
                                                  None if w is None else small + iw_off[w.key], st),
                             f"the quantize pass on {item.members[g[j0]].name}")
            out = rt.pool.get(size)
            rt.copy(out.ptr, dout, size, D2H)
            done = rt.event().record(st)
            # NVFP4: pass 1's sync saw the input copy complete; MXFP4: the reader waits for this event
            # (the input copy precedes it) before refilling
            return _Outputs(None if nvfp4 else done, done, out, keep, [pos[i] for i in range(n)], layout, tail, n,
                            nvfp4, ga)

        return two_passes(item, s, amax_pass, quantize_pass)


def _weight_slots(weights: list[InputWeight | None], start: int) -> tuple[dict[str, int], int]:
    """Each input weight's offset in the small arena (once per key, aligned, from ``start``) and the arena's end."""
    iw_off: dict[str, int] = {}
    end = start
    for w in weights:
        if w is not None and w.key not in iw_off:
            iw_off[w.key] = end
            end = align(end + len(w.data))
    return iw_off, end


def _upload_weights(
    rt: Runtime, weights: list[InputWeight | None], iw_off: dict[str, int], small: int, small_n: int
) -> HostBuffer:
    """Queue the copy of the input weights into their slots of the small arena at device address ``small``;
    returns the pinned buffer the asynchronous copy reads (kept until the batch completes)."""
    n_iw = small_n - iw_off[next(iter(iw_off))]
    up_iw = rt.pool.get(n_iw)
    base = small_n - n_iw
    for w in weights:
        if w is not None:
            up_iw.view(iw_off[w.key] - base, len(w.data))[:] = w.data
    rt.copy(small + base, up_iw.ptr, n_iw, H2D)
    return up_iw


class _Outputs(Pending):
    """A batch's pass 2 in flight: every output arrives in the pinned buffer ``out`` once ``done``
    completes; :meth:`result` waits for it (on a writer thread) and reads the flags and scales there."""

    def __init__(self, inputs_free: Event | None, done: Event, out: HostBuffer, keep: list, pos: list[int],
                 layout: list, tail: int, n: int, nvfp4: bool, ga: list[float] | None) -> None:
        super().__init__(inputs_free=inputs_free)
        self.done, self.out, self.keep = done, out, keep  # keep: pinned buffers the copies still read or write
        self.pos, self.layout, self.tail, self.n, self.nvfp4, self.ga = pos, layout, tail, n, nvfp4, ga

    def result(self) -> Result:
        with timing.timed("write_waits_gpu"):
            self.done.synchronize()  # in the writer thread
        self.keep.clear()
        out, tail, n, pos, ga = self.out, self.tail, self.n, self.pos, self.ga
        flags = array("i", bytes(out.view(tail + 4 * n, 4 * n)))
        gsv = array("f", bytes(out.view(tail, 4 * n))) if self.nvfp4 else None
        matrices: list[MatrixOut | None] = []
        for i in range(n):
            p_off, p_n, s_off, s_n = self.layout[i]
            matrices.append(MatrixOut(out.view(p_off, p_n), out.view(s_off, s_n),
                                      None if gsv is None else gsv[pos[i]], None if ga is None else ga[i]))
        return Result(matrices, [bool(flags[pos[i]]) for i in range(n)], keep=out)


def output_layout(item: Batch, items: list, settings: Settings) -> tuple[list[int], list, list, int]:
    """Where a batch's outputs go in one buffer: ``(pos, per matrix (p_off, p_n, s_off, s_n), launches,
    size)``. Per-matrix values sit in shape-group order (member i at slot ``pos[i]``); each group's
    packed codes ``[B, M, K/2]``, then its scales ``[B, rows, cols]`` (padded when swizzled), at aligned
    offsets; a launch is ``(group, input offset, info, m, k, p_off, s_off)``."""
    bs = settings.scheme.block_size
    n = len(item.members)
    pos = [0] * n
    for slot, i in enumerate(i for g in item.groups for i in g):
        pos[i] = slot
    where: list = [None] * n
    launches, size = [], 0
    for g in item.groups:
        info = items[g[0]][1]
        m, k = info.shape
        rows, cols = padded_shape(m, k // bs) if settings.swizzle else (m, k // bs)
        p_n, s_n = m * k // 2, rows * cols
        p_off = size
        s_off = align(p_off + len(g) * p_n)
        size = align(s_off + len(g) * s_n)
        for j, i in enumerate(g):
            where[i] = (p_off + j * p_n, p_n, s_off + j * s_n, s_n)
        launches.append((g, items[g[0]][0], info, m, k, p_off, s_off))
    return pos, where, launches, size


BACKEND = CudaBackend
