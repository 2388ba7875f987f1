"""The ``stacked`` backend: torch, every shape group of a batch one ``[B, M, K]`` launch.

It runs every unit kind (stacked experts, decoded FP8 / MXFP4 inputs) and under torchrun, on
:mod:`fp4convert.kernels.cuda.ops`. On CUDA the host-to-device copies go on a copy stream, the passes and the
device-to-host copies (into pinned memory) on a compute stream; the host waits for the GPU twice per
batch: for pass 1's amax (each fused group's max is taken on the host, :func:`~fp4convert.quantizer.backend.
unit_amax`), and in the writer thread for the outputs. On the CPU (``--device cpu --backend stacked``)
the same code runs with no streams on :data:`fp4convert.quantizer.backends.cpu.OPS`, which has the CUDA ops'
signature: that is how the tests check this scheduling without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch

from fp4convert import timing
from fp4convert.kernels.tensor import as_bytes
from fp4convert.quantizer.backend import (
    IN_USE,
    Context,
    Inputs,
    MatrixOut,
    Pending,
    Result,
    Settings,
    Staged,
    matrix_weights,
    two_passes,
    weight_runs,
)
from fp4convert.quantizer.backends.cpu import weight_tensors
from fp4convert.quantizer.items import Batch, Item
from fp4convert.quantizer.matrices import TensorBuffer, kept_output, launch_groups, nonfinite_bytes, tensors, unit_weights


class StackedBackend:
    """Batched launches per shape group; CUDA: streams, pinned memory, events (see the module's docstring)."""

    name: ClassVar[str] = "stacked"
    # Consecutive units share launches up to these limits (pinned memory: two buffer sets).
    batch_units: ClassVar[int] = 128
    batch_bytes: ClassVar[int] = 256 << 20
    auto_lanes: ClassVar[int] = 1

    def __init__(self, settings: Settings, device: torch.device) -> None:
        self.s = settings
        self.device = device
        self.cuda = device.type == "cuda"
        self.ops: Any
        if self.cuda:
            from fp4convert.kernels.cuda import ops

            self.copy = torch.cuda.Stream(device)
            self.compute = torch.cuda.Stream(device)
            self.ops = ops
        else:
            from fp4convert.quantizer.backends.cpu import OPS

            self.ops = OPS

    @classmethod
    def supports(cls, plan) -> bool:
        return True

    @classmethod
    def open(cls, ctx: Context) -> StackedBackend:
        device = torch.device(ctx.device)
        if device.type == "cuda":
            from fp4convert.kernels.cuda import ops

            torch.cuda.set_device(device)  # under torchrun: this rank's GPU for every stream and buffer
            ops.ensure_loaded(device)
        return cls(ctx.settings, device)

    def lane(self) -> StackedBackend:
        return StackedBackend(self.s, self.device)

    def thread_init(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)

    def host_buffer(self, nbytes: int) -> TensorBuffer:
        return TensorBuffer(nbytes, pinned=self.cuda)

    def nonfinite(self, dtype: str, data: memoryview) -> bool:
        return nonfinite_bytes(dtype, data)

    def close(self) -> None:
        pass

    def _stream(self, which: str):
        return torch.cuda.stream(getattr(self, which)) if self.cuda else contextlib.nullcontext()

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def _upload(self, values: list[float]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.float32)
        return t.pin_memory().to(self.device, non_blocking=True) if self.cuda else t

    def _event(self):
        if not self.cuda:
            return None
        e = torch.cuda.Event()
        e.record(self.compute)
        return e

    def stage(self, item: Item, inputs: Inputs) -> Staged:
        """The item's inputs on the device, ``state``: a batch's launch groups (each with its matrices'
        indices), a unit's read tensors (quantize() decodes and groups them). On CUDA the inputs are
        free once the copies out of the pinned set are done (``inputs_free``: their event, recorded right
        after them). On the CPU a batch's members are copied into its groups (free now); a unit's
        tensors are views of the inputs, in use until quantize() returns (the CPU ops are synchronous)."""
        with self._stream("compute"):
            return self._stage(item, inputs)

    def _stage(self, item: Item, inputs: Inputs) -> Staged:
        hosts = tensors(inputs)
        dev = self.device
        if isinstance(item, Batch):
            # Host-to-device: each shape group into one [B, M, K] tensor (no stacking copy on the host).
            # The inputs are allocated on the copy stream, which writes them: a block the caching
            # allocator hands out there is free of every earlier copy-stream use, and of the compute
            # kernels that read earlier inputs (record_stream below). Allocated on the compute stream,
            # a block last used by the previous batch's still-queued kernels (its packed outputs)
            # could be overwritten by this batch's copies before those kernels ran (seen on the H100:
            # a 64-expert MoE refused for NaN that was not in the source).
            with self._stream("copy"):
                xs = [torch.empty((len(g), *hosts[g[0]].shape), dtype=hosts[g[0]].dtype, device=dev)
                      for g in item.groups]
                for x, g in zip(xs, item.groups):
                    for j, i in enumerate(g):
                        x[j].copy_(hosts[i], non_blocking=self.cuda)
                    if self.cuda:
                        x.record_stream(self.compute)
                done = None
                if self.cuda:
                    done = torch.cuda.Event()
                    done.record(self.copy)
            if self.cuda:
                self.compute.wait_event(done)
            return Staged(item, inputs, done, list(zip(xs, item.groups)))
        on_device = [h.to(dev, non_blocking=self.cuda) for h in hosts]
        # CUDA: the copies out of the pinned set are queued before the event; on the CPU the tensors are
        # views of the inputs: in use until quantize() is done with them
        return Staged(item, inputs, self._event() if self.cuda else IN_USE, on_device)

    def quantize(self, staged: Staged) -> Pending:
        """Both passes on the staged launch groups (a unit's weights decoded and grouped first): pass 1
        synced (each fused group's amax on the host), pass 2 queued (CUDA) or done (CPU); the result
        waits for pass 2's copies to the host. A kept quantized input: the fp32 weight it encodes."""
        item = staged.item
        if isinstance(item, Batch):
            groups = staged.state
        else:
            with self._stream("compute"):
                weights = unit_weights(item, staged.state)
                if item.kept:  # a kept quantized input: written as the fp32 weight it encodes (--kept-dtype bf16: BF16)
                    w = self._to_host(kept_output(item.members[0], weights[0]).contiguous())
                    return _Kept(Result([], [], [(item.members[0].name, as_bytes(w))], keep=w), self._event())
                groups = launch_groups(item, weights)
        s = self.s
        n = len(item.matrices)

        def amax_pass() -> list[float]:
            with self._stream("compute"):
                per_group = [self.ops.amax(x, s.rotate) for x, _ in groups]
                host = self._to_host(torch.cat(per_group)) if per_group else torch.zeros(0)
                e = self._event()
            with timing.timed("quantize_waits_gpu"):
                if e is not None:
                    e.synchronize()  # the batch's first sync: each fused group's amax is taken on the host
            amax = [0.0] * n
            flat = host.tolist()
            k = 0
            for _, idx in groups:
                for i in idx:
                    amax[i] = flat[k]
                    k += 1
            return amax

        def quantize_pass(ga: list[float] | None) -> Pending:
            outs: list = []
            weights = matrix_weights(item)
            with self._stream("compute"):
                iw = weight_tensors(weights, self.device)  # one upload per input weight of the item
                for xg, group in groups:
                    # a launch takes one input weight: a group whose members have several is cut in runs
                    for j0, j1, _ in weight_runs(group, weights):
                        x, idx = (xg, group) if (j0, j1) == (0, len(group)) else (xg[j0:j1], group[j0:j1])
                        given = None if ga is None else self._upload([ga[i] for i in idx])
                        p, sc, gs, flag = self.ops.quantize(x, s.scheme.name, given, s.rotate, s.swizzle, s.rule,
                                                            input_weight=iw[idx[0]])
                        meta = [flag.reshape(-1).to(torch.float32)] + ([] if gs is None else [gs.reshape(-1)])
                        outs.append((idx, self._to_host(p), self._to_host(sc.view(torch.uint8)),
                                     self._to_host(torch.cat(meta))))
                done = self._event()
            return _Outputs(n, outs, done, ga)

        return two_passes(item, s, amax_pass, quantize_pass)


class _Kept(Pending):
    """A kept quantized input's fp32 weight, copied to the host: done once the event is (None: now).
    Its inputs were released at staging (CUDA) or are free now (the CPU decoded them synchronously)."""

    def __init__(self, result: Result, done: Any) -> None:
        super().__init__(result, inputs_free=None)
        self.done = done
        result.keep = (result.keep, done)

    def result(self) -> Result:
        if self.done is not None:
            self.done.synchronize()
        return super().result()


class _Outputs(Pending):
    """Pass 2's outputs on their way to the host (pinned on CUDA): :meth:`result` waits for the event
    (on a writer thread, None: the CPU, already there) and reads the flags and global scales.
    ``inputs_free`` None: on CUDA they were released at staging, on the CPU the passes are done with them."""

    def __init__(self, n: int, outs: list, done: Any, ga: list[float] | None) -> None:
        super().__init__(inputs_free=None)
        self.n, self.outs, self.done, self.ga = n, outs, done, ga

    def result(self) -> Result:
        if self.done is not None:
            with timing.timed("write_waits_gpu"):
                self.done.synchronize()  # in the writer thread
        n, ga = self.n, self.ga
        matrices: list[MatrixOut | None] = [None] * n
        refused = [False] * n
        for idx, p, sc, meta in self.outs:
            m = meta.tolist()
            flags, gss = m[: len(idx)], m[len(idx):]
            for j, i in enumerate(idx):
                refused[i] = bool(flags[j])
                matrices[i] = MatrixOut(as_bytes(p[j]), as_bytes(sc[j]), gss[j] if gss else None,
                                        None if ga is None else ga[i])
        return Result(matrices, refused, keep=self.outs)


BACKEND = StackedBackend
