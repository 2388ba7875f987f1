"""The CUDA path without torch: plain 2-D weights from pinned buffers through the kernels to the shards.

A conversion whose quantized tensors are all whole 2-D bf16/fp16/fp32 matrices (the usual
checkpoint) runs here, on :mod:`fp4convert.cuda.runtime` and the kernel library alone, when it is
one process and the device is CUDA. It never imports torch, whose import alone took 4 s on the H100
machine, as long as `cp -r` of a 5.6 GB checkpoint. Everything else (stacked experts, FP8 / MXFP4
inputs, torchrun, the CPU) runs on :mod:`fp4convert.pipeline`; the bytes are the same either way
(tests/test_direct.py compares the two on the GPU).

Per batch (the reader filled one pinned buffer with its members, each shape group back to back),
on one stream: one host-to-device copy of the whole buffer; pass 1 (amax of every matrix, one
launch per shape group); one host sync, after which the reader may refill the buffer and the host
takes each unit's amax (the max over a fused group); pass 2 (quantize with the unit's amax, one
launch per shape group; the kernel computes gs); one device-to-host copy of every output, gs and
flag into a pooled pinned buffer, and an event the writer thread waits for.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable

from . import stages
from .cuda.runtime import D2H, H2D, DeviceArena, Runtime, align
from .errors import nonfinite_error
from .schedule import Batch, Settings
from .swizzle import padded_shape

# Batches: smaller than the torch pipeline's (256 MB): pinned memory costs ~0.8 s per GB to allocate on
# the H100 machine and the GPU's share of a batch is a few milliseconds, so two 64 MB sets suffice.
BATCH_UNITS, BATCH_BYTES = 128, 64 << 20
DTYPE_CODES = {"F32": 0, "F16": 1, "BF16": 2}  # the launchers' dtype ints
FMT_CODES = {"nvfp4": 0, "mxfp4": 1}


class DirectBackend:
    """The batches' two passes on one stream, with device arenas reused from batch to batch."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.dev_in, self.dev_out, self.dev_small = DeviceArena(rt), DeviceArena(rt), DeviceArena(rt)

    def close(self) -> None:
        for a in (self.dev_in, self.dev_out, self.dev_small):
            a.free()

    def run(self, batch: Batch, hosts, s: Settings, free: Callable) -> Callable[[], tuple]:
        """``hosts``: (pinned buffer, [(offset, info)]) from the reader, each shape group's members back
        to back (:func:`~fp4convert.schedule.grouped_offsets`); returns the writer's result()."""
        rt, lib, st = self.rt, self.rt.lib, self.rt.stream
        buf, items = hosts
        n = len(batch.members)
        total = max(off + info.nbytes for off, info in items)
        din = self.dev_in.at_least(total)
        rt.copy(din, buf.ptr, total, H2D)
        fmt = s.scheme.name
        nvfp4 = s.scheme.global_scale
        rotate = int(s.rotate == "had16")
        bs = s.scheme.block_size
        rule = _rule_code(s.scheme, s.extra.get("scale_rule"))
        # One launch per shape group (all experts' gate/up of a batch, say): its inputs are one
        # [B, M, K] array in the buffer. Per-matrix values (amax, unit amax, gs, flags) sit in group
        # order: member i at slot pos[i]. Outputs, in one device arena copied back at once: each group's
        # packed codes [B, M, K/2], then its scales [B, rows, cols], at aligned offsets; then gs and
        # the flags of every matrix.
        groups = batch.groups
        order = [i for g in groups for i in g]
        pos = [0] * n
        for k, i in enumerate(order):
            pos[i] = k
        layout: list = [None] * n
        launches, size = [], 0
        for g in groups:
            info = items[g[0]][1]
            m, k = info.shape
            rows, cols = padded_shape(m, k // bs) if s.swizzle else (m, k // bs)
            p_n, s_n = m * k // 2, rows * cols
            p_off = size
            s_off = align(p_off + len(g) * p_n)
            size = align(s_off + len(g) * s_n)
            for j, i in enumerate(g):
                layout[i] = (p_off + j * p_n, p_n, s_off + j * s_n, s_n)
            launches.append((g, items[g[0]][0], info, m, k, p_off, s_off))
        tail = size
        size += 8 * n
        dout = self.dev_out.at_least(size)
        d_gs, d_flag = dout + tail, dout + tail + 4 * n
        small = self.dev_small.at_least(8 * n)  # pass 1's amax, pass 2's (unit) amax
        d_amax, d_ga = small, small + 4 * n
        amax = ga = None
        keep: list = []  # pinned buffers an asynchronous copy still reads or writes
        bad: list[bool] = [False] * n
        if nvfp4:
            for g, off, info, m, k, _, _ in launches:
                rt.check(lib.fp4c_amax(din + off, DTYPE_CODES[info.dtype], rotate, len(g), m * k, d_amax + 4 * pos[g[0]],
                                       st), f"the amax pass on {batch.members[g[0]].name}")
            back = rt.pool.get(4 * n)
            rt.copy(back.ptr, d_amax, 4 * n, D2H)
            with stages.timed("quantize_waits_gpu"):
                rt.sync()  # the batch's one sync before pass 2: the unit's amax is taken on the host
            free(None)  # the input copy is complete: the reader may refill the buffer
            slots = array("f", bytes(back.view(0, 4 * n)))
            amax = [slots[pos[i]] for i in range(n)]
            bad = [not math.isfinite(a) for a in amax]
            ga = _unit_amax(amax, batch)
            up = rt.pool.get(4 * n)
            up.view(0, 4 * n)[:] = array("f", [ga[i] for i in order]).tobytes()
            rt.copy(d_ga, up.ptr, 4 * n, H2D)
            keep.append(up)
        if not any(bad):
            rt.memset(d_flag, 0, 4 * n)  # the launches only set flags
            for g, off, info, m, k, p_off, s_off in launches:
                slot = 4 * pos[g[0]]
                rt.check(lib.fp4c_quantize(din + off, DTYPE_CODES[info.dtype], FMT_CODES[fmt], rotate, int(s.swizzle),
                                           rule, len(g), m, k, d_ga + slot if nvfp4 else None,
                                           d_gs + slot if nvfp4 else None, dout + p_off, dout + s_off, d_flag + slot,
                                           st),
                         f"the quantize pass on {batch.members[g[0]].name}")
        out = rt.pool.get(size)
        rt.copy(out.ptr, dout, size, D2H)
        done = rt.event().record(st)
        if not nvfp4:
            free(done)  # the reader waits for this event (the input copy precedes it) before refilling

        def result() -> tuple:
            with stages.timed("write_waits_gpu"):
                done.synchronize()  # in the writer thread
            keep.clear()
            if any(bad):
                return out, layout, bad, amax, ga, None
            flags = array("i", bytes(out.view(tail + 4 * n, 4 * n)))
            gsv = array("f", bytes(out.view(tail, 4 * n))) if nvfp4 else None
            return (out, layout, [bool(flags[pos[i]]) for i in range(n)], amax, ga,
                    None if gsv is None else [gsv[pos[i]] for i in range(n)])

        return result


def _rule_code(scheme, rule: str | None) -> int:
    """The launchers' int for a scale rule: its index in the scheme's list (CONTRACT.md)."""
    return scheme.scale_rules.index(scheme.check_rule(rule))


def _unit_amax(amax: list[float], batch: Batch) -> list[float]:
    """Per member: the max amax over its unit (a fused group shares one global scale)."""
    out, start = [], 0
    for u in batch.units:
        m = max(amax[start : start + len(u)])
        out += [m] * len(u)
        start += len(u)
    return out


def write_batch(batch: Batch, result: Callable[[], tuple], s: Settings, fmt, writers, records: dict) -> Callable[[], None]:
    """The writer-thread job of a batch: wait for its outputs, refuse NaN/Inf, fill records, write bytes."""

    def job() -> None:
        out, layout, bad, amax, ga, gs = result()
        for i, d in enumerate(batch.members):
            if bad[i]:
                raise nonfinite_error(d.name, d.info.file, s.rotate)
        for i, d in enumerate(batch.members):
            p_off, p_n, s_off, s_n = layout[i]
            g = None if gs is None else gs[i]
            if g is not None:
                records[d.name]["global_scale"] = g
                records[d.name]["amax"] = ga[i]
            for name, data in fmt.raw_tensors(d.module, out.view(p_off, p_n), out.view(s_off, s_n), g,
                                              s.scheme.name, s.rotate):
                writers.tensor(name, data, owner=out)

    return job

