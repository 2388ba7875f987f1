"""Tuned rounding (issue 46) prototyped block by block on a real LM: MXFP4A16 / NVFP4A16 KL beside GPTQ.

A probe, not the converter: it drives transformers directly (the model of ``benchmarks/accuracy.py``, fp32, in
memory), quantizes every ``nn.Linear`` of the decoder blocks (not the head, not the embeddings: what both
converters quantize) with the arithmetic of :mod:`fp4convert.numerics.tuned`, and scores the result with
``accuracy.evaluate`` (mean next-token KL against the unquantized model on the 2048 held-out tokens of
``benchmarks/accuracy_gptq.py``). The calibration tokens are accuracy_gptq's (``calibration()``: 32 x 256
windows of the standard library's docstrings), so the figures sit beside that benchmark's rows
(``benchmarks/results/cpu2_2026112*_accuracy_gptq_*.json``: fp4convert GPTQ and llm-compressor's GPTQ).

The algorithm (docs/numerics.md "Tuned rounding"), per block in model order:

1. the block's inputs are the outputs of the blocks already quantized (the quantized stream, ``Xq``); with
   ``--target fp`` the unquantized model's own stream ``Xf`` is carried beside it (AutoRound's target);
2. the target: the unquantized block's outputs on ``Xq`` (``--target same``) or on ``Xf`` (``--target fp``);
   each linear's input mean squares on ``Xq`` are observed in the same pass (``--start-weights inputs``);
3. every quantized matrix starts from the data-free quantizer's scales (``--rule``, optionally input-weighted),
   NVFP4's global scale from its fused group's amax (q/k/v, gate/up); offsets ``v`` and scale moves ``t`` zero;
4. ``--iters`` signed-gradient steps: ``--batch`` samples drawn without replacement (a seeded permutation per
   pass over the samples), the block's forward with the straight-through weights (exactly the weights the
   bytes decode to), loss = mean squared error against the target, ``v -= lr_i sign(grad)`` clamped to
   [-0.5, 0.5], ``t -= slr_i sign(grad)`` clamped to [-1, 1], rates decaying linearly to 0; the step with the
   lowest batch loss is kept (its parameters as they were when that loss was measured);
5. guard (``--guard``): the kept parameters' loss on all samples against the start's; the lower wins;
6. the final bytes by :func:`fp4convert.numerics.tuned.quantize`; the block is loaded with their decode and
   run on ``Xq`` to make the next block's inputs.

Each run appends one row to ``--json`` (its settings, the command, KL / perplexity / top-1, per-block losses
and seconds, a FLOP estimate). It runs unchanged on CUDA (``--device cuda``: the calibration there, the
evaluation on the CPU):

    python benchmarks/tuned_probe.py --model smollm2-135m --scheme mxfp4 --iters 50 \\
        --json benchmarks/results/cpu2_20261130_tuned_probe_smollm2-135m.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
# benchmarks/kernels.py would shadow the ``kernels`` package transformers imports (hub kernels): import it first
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
import transformers.activations  # noqa: E402,F401

sys.path.insert(0, str(ROOT))
from fp4convert.numerics import tuned  # noqa: E402
from fp4convert.numerics.scheme import SCHEMES  # noqa: E402

sys.path.insert(1, str(HERE))
import accuracy as acc  # noqa: E402
import accuracy_gptq as agptq  # noqa: E402

log = logging.getLogger("tuned_probe")
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # one NVFP4 global scale each


@dataclass(frozen=True)
class Settings:
    scheme: str = "mxfp4"
    rule: str | None = None  # the start's scale rule (None: the scheme's default)
    start_weights: str = "none"  # "inputs": the start's search weighted by each input's mean squares (Xq)
    iters: int = 50
    lr: float | None = None  # None: 1 / iters (AutoRound's default)
    scale_lr: float = 0.0  # 0: the rule's scales stay (no scale moves)
    batch: int = 8  # samples per step
    unit: str = "step"
    target: str = "same"  # "same": the unquantized block on Xq; "fp": on the unquantized stream Xf
    best: str = "batch"  # "batch": the step with the lowest batch loss; "last": the last parameters
    guard: bool = True
    seed: int = 0
    init: str = "rtn"  # "gptq": start from GPTQ's codes (act-order, damp 0.01) on the block's inputs Xq
    fallback: str = "none"  # "gptq": also GPTQ each block; keep it where its calibration loss is lower
    norm_iters: int = 0  # then the block's norm gains tuned (signed steps, relative) with the linears fixed
    norm_lr: float = 0.002

    @property
    def rate(self) -> float:
        return self.lr if self.lr is not None else 1.0 / max(self.iters, 1)


# ---------------------------------------------------------------------------------------------
# The block stream
# ---------------------------------------------------------------------------------------------

class Stop(Exception):
    """Raised by the first block's recorder once its input is recorded (the rest of the forward is not needed)."""


def capture(model: torch.nn.Module, layers: torch.nn.ModuleList, tokens: torch.Tensor, micro: int):
    """(block 0's inputs [S, T, H], every block's keyword arguments for a micro-batch of ``micro`` samples):
    one full forward records every block's arguments, the others stop at block 0."""
    kwargs: list[dict | None] = [None] * len(layers)
    firsts: list[torch.Tensor] = []
    hooks = []

    def rec(i):
        def hook(_m, args, kw):
            if i == 0:
                firsts.append((args[0] if args else kw["hidden_states"]).detach())
            if kwargs[i] is None:
                kwargs[i] = {k: v for k, v in kw.items() if k != "hidden_states"}
            elif i == 0:
                raise Stop
        return hook

    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(rec(i), with_kwargs=True))
    try:
        with torch.no_grad():
            for k in range(0, tokens.shape[0], micro):
                try:
                    model(input_ids=tokens[k:k + micro], use_cache=False)
                except Stop:
                    pass
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(firsts), kwargs


def sliced(kw: dict, n: int, micro: int) -> dict:
    """The recorded keyword arguments for ``n`` samples (tensors whose first dim is the micro-batch cut to n)."""
    def cut(v):
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == micro and n != micro:
            return v[:n]
        if isinstance(v, tuple):
            return tuple(cut(u) for u in v)
        return v
    return {k: cut(v) for k, v in kw.items()}


def run_block(layer, x: torch.Tensor, kw: dict, micro: int, weights: dict | None = None) -> torch.Tensor:
    """The block on ``x`` [n, T, H] (in micro-batches when not differentiating), optionally with ``weights``
    (module-relative parameter name -> tensor) in place of its own."""
    outs = []
    for k in range(0, x.shape[0], micro):
        xb = x[k:k + micro]
        args = (xb,)
        kws = sliced(kw, xb.shape[0], micro)
        y = torch.func.functional_call(layer, weights, args, kws) if weights else layer(*args, **kws)
        outs.append(y[0] if isinstance(y, tuple) else y)
    return torch.cat(outs)


# ---------------------------------------------------------------------------------------------
# One block
# ---------------------------------------------------------------------------------------------

def linears(layer: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}


def input_stats(layer, x: torch.Tensor, kw: dict, micro: int, hessians: bool = False):
    """(the block's outputs on x, each linear's mean input square per channel (fp64 sums -> fp32), and with
    ``hessians`` each linear's X^T X / n (fp64))."""
    sums: dict[str, torch.Tensor] = {}
    xtx: dict[str, torch.Tensor] = {}
    count: dict[str, int] = {}
    hooks = []
    for n, m in linears(layer).items():
        def hook(_m, args, _n=n):
            a = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[_n] = sums.get(_n, 0) + (a * a).sum(0)
            if hessians:
                xtx[_n] = xtx.get(_n, 0) + a.T @ a
            count[_n] = count.get(_n, 0) + a.shape[0]
        hooks.append(m.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            y = run_block(layer, x, kw, micro)
    finally:
        for h in hooks:
            h.remove()
    return y, {n: (sums[n] / count[n]).float() for n in sums}, {n: xtx[n] / count[n] for n in xtx}


def gptq_start(w: torch.Tensor, h: torch.Tensor, st: Settings, amax) -> tuple[torch.Tensor, tuned.Start]:
    """GPTQ (act-order, damp 0.01, rule ``st.rule`` or mse) of ``w`` on Hessian ``h``, as (the sweep's values
    before each column's rounding, the start of its scale bytes): tuned with zero offsets, that source and
    start give GPTQ's codes (a reconstructed value whose code differs at a tie is replaced by its decode)."""
    from fp4convert.numerics import gptq

    bs = SCHEMES[st.scheme].block_size
    p = gptq.prepare(h.to(w.device), gptq.DAMP, bs)
    cols: list[torch.Tensor] = []

    def record(w1, u1, scheme, rule, am, iw):
        c, b, vals, errs = gptq.sweep_batch(w1, u1, scheme, rule, am, iw)
        cols.append(vals + errs * torch.diagonal(u1)[None, :])  # the value rounded, up to a rounding of e * u
        return c, b, vals, errs

    res = gptq.quantize(w, p, st.scheme, st.rule or "mse", amax, gptq.BLOCK, record)
    wc = torch.cat(cols, 1)
    if p.perm is not None:
        wc = wc[:, torch.argsort(p.perm)]
    s = tuned.Start(st.scheme, res.scale.view(torch.uint8), res.gs)
    same = tuned.quantize(wc, s).packed == res.packed
    wc = torch.where(ref_unpack(same), wc, res.dequantized)
    assert torch.equal(tuned.quantize(wc, s).packed, res.packed)
    return wc, s


def ref_unpack(same_bytes: torch.Tensor) -> torch.Tensor:
    """Per element: whether its packed byte was the same (both nibbles of a byte share the verdict)."""
    return same_bytes.repeat_interleave(2, dim=-1)


def starts(layer, st: Settings, squares: dict[str, torch.Tensor], hess: dict[str, torch.Tensor],
           init: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, tuned.Start]]:
    """Each linear's source values and start: the weights and the rule's scale bytes (input-weighted if asked),
    or GPTQ's (``init``, default ``st.init``, "gptq"); NVFP4's group amax shared."""
    init = init or st.init
    lins = linears(layer)
    amax: dict[str, torch.Tensor] = {}
    if SCHEMES[st.scheme].global_scale:
        for n, m in lins.items():
            key = next((n.replace(p, "+".join(g)) for g in FUSED for p in g if n.endswith(p)), n)
            a = m.weight.detach().float().abs().amax()
            amax[key] = torch.maximum(amax[key], a) if key in amax else a
    out, src = {}, {}
    for n, m in lins.items():
        key = next((n.replace(p, "+".join(g)) for g in FUSED for p in g if n.endswith(p)), n)
        w = m.weight.detach().float()
        if init == "gptq":
            src[n], out[n] = gptq_start(w, hess[n], st, amax.get(key))
            continue
        iw = squares.get(n) if st.start_weights == "inputs" else None
        src[n], out[n] = w, tuned.start(w, st.scheme, st.rule, amax.get(key), iw)
    return src, out


def block_loss(layer, x, y, kw, micro, w: dict, s: dict, v: dict, t: dict | None, unit: str,
               per_sample: bool = False) -> torch.Tensor:
    """The block's output MSE against ``y`` with the stand-in weights (one value, or one per sample)."""
    weights = {f"{n}.weight": tuned.fake_quantize(w[n], s[n], v[n], None if t is None else t[n], unit) for n in w}
    out = run_block(layer, x, kw, micro, weights)
    return ((out - y) ** 2).mean(dim=(1, 2)) if per_sample else ((out - y) ** 2).mean()


def tune_block(layer, xq: torch.Tensor, y: torch.Tensor, kw: dict, micro: int, st: Settings, w: dict[str, torch.Tensor],
               s: dict[str, tuned.Start], gen: torch.Generator) -> tuple[dict, dict | None, dict]:
    """The signed-gradient loop of one block (steps 4-5 of the module docstring) from the sources ``w`` and starts
    ``s``: the kept (v, t) and a record. A step's score is its batch loss over the start's loss on the same
    samples (measured once, per sample, before the loop): batches differ in difficulty, so raw batch losses
    would keep the step that drew the easiest batch."""
    dev = xq.device
    v = {n: torch.zeros_like(w[n], requires_grad=True) for n in w}
    t = {n: torch.zeros(s[n].scale.shape, device=dev, requires_grad=True) for n in w} if st.scale_lr else None
    params = list(v.values()) + (list(t.values()) if t else [])
    zero = {n: torch.zeros_like(w[n]) for n in w}
    with torch.no_grad():
        base = block_loss(layer, xq, y, kw, micro, w, s, zero, None, st.unit, per_sample=True)
    best = (1.0, -1, (zero, None))  # the start itself scores 1
    order: list[int] = []
    trace = []
    for i in range(st.iters):
        if len(order) < st.batch:
            order = torch.randperm(xq.shape[0], generator=gen).tolist()
        idx, order = order[:st.batch], order[st.batch:]
        loss = block_loss(layer, xq[idx], y[idx], kw, micro, w, s, v, t, st.unit)
        score = loss.item() / base[idx].mean().item()
        trace.append(round(score, 4))
        if st.best == "batch" and score < best[0]:
            best = (score, i, ({n: p.detach().clone() for n, p in v.items()},
                               {n: p.detach().clone() for n, p in t.items()} if t else None))
        for p in params:
            p.grad = None
        loss.backward()
        for p in v.values():
            tuned.signed_step(p, p.grad, tuned.learning_rate(st.rate, i, st.iters), tuned.OFFSET_LIMIT)
        for p in (t or {}).values():
            tuned.signed_step(p, p.grad, tuned.learning_rate(st.scale_lr, i, st.iters), tuned.SCALE_LIMIT)
    if st.best == "last":
        best = (float("nan"), st.iters, ({n: p.detach() for n, p in v.items()},
                                         {n: p.detach() for n, p in t.items()} if t else None))
    kv, kt = best[2]
    rec = {"best_score": best[0], "best_iter": best[1], "scores": trace, "start_loss": base.mean().item()}
    if st.guard and best[1] >= 0:
        with torch.no_grad():
            l1 = block_loss(layer, xq, y, kw, micro, w, s, kv, kt, st.unit).item()
        rec.update(tuned_loss=l1, kept="tuned" if l1 < rec["start_loss"] else "start")
        if l1 >= rec["start_loss"]:
            kv, kt = zero, None
    return kv, kt, rec


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

def block_flops(layer, tokens: int, seq: int, config) -> float:
    """Forward + backward FLOPs of one step on ``tokens`` tokens (3x the forward: the input and weight
    gradients): 2 per weight per token, plus attention's two products (4 * tokens * seq * heads * head_dim)."""
    params = sum(m.weight.numel() for m in linears(layer).values())
    heads = getattr(config, "num_attention_heads", 0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // max(heads, 1)
    return 3.0 * (2.0 * tokens * params + 4.0 * tokens * seq * heads * head_dim)


def norms(layer) -> dict[str, torch.nn.Module]:
    """The block's normalisation modules with a gain (RMSNorm / LayerNorm weights, q/k norms included)."""
    return {n: m for n, m in layer.named_modules()
            if "norm" in type(m).__name__.lower() and isinstance(getattr(m, "weight", None), torch.Tensor)}


def tune_norms(layer, xq, y, kw, micro, st: Settings, lin: dict[str, torch.Tensor], gen: torch.Generator):
    """The block's norm gains tuned against the target with the quantized linears ``lin`` fixed (AutoRound's norm
    tuning, after the rounding): each gain g (as the module applies it, ``w`` or Gemma's ``1 + w``) becomes
    ``g * (1 + u)``, ``u`` per channel by signed steps in [-0.5, 0.5], scored and kept as in :func:`tune_block`.
    Returns (the new norm weights in their dtype, module-relative names, or None if the start is kept; a record)."""
    mods = norms(layer)
    w0 = {n: m.weight.detach().float().clone() for n, m in mods.items()}
    with torch.no_grad():  # the effective gain per channel: the module's output on a vector of ones (rms 1)
        gain = {n: m(torch.ones(1, w0[n].numel(), device=xq.device, dtype=m.weight.dtype)).float()[0] for n, m in mods.items()}
    u = {n: torch.zeros_like(w0[n], requires_grad=True) for n in mods}
    fixed = {f"{n}.weight": w for n, w in lin.items()}

    def loss_of(idx, per_sample=False):
        ws = {**fixed, **{f"{n}.weight": w0[n] + u[n] * gain[n] for n in mods}}
        out = run_block(layer, xq[idx], kw, micro, ws)
        return ((out - y[idx]) ** 2).mean(dim=(1, 2)) if per_sample else ((out - y[idx]) ** 2).mean()

    everything = list(range(xq.shape[0]))
    with torch.no_grad():
        base = loss_of(everything, per_sample=True)
    best = (1.0, -1, None)
    order: list[int] = []
    for i in range(st.norm_iters):
        if len(order) < st.batch:
            order = torch.randperm(xq.shape[0], generator=gen).tolist()
        idx, order = order[:st.batch], order[st.batch:]
        loss = loss_of(idx)
        score = loss.item() / base[idx].mean().item()
        if score < best[0]:
            best = (score, i, {n: p.detach().clone() for n, p in u.items()})
        for p in u.values():
            p.grad = None
        loss.backward()
        for p in u.values():
            tuned.signed_step(p, p.grad, tuned.learning_rate(st.norm_lr, i, st.norm_iters), 0.5)
    rec = {"norm_best_score": best[0], "norm_best_iter": best[1], "norm_start_loss": base.mean().item()}
    if best[2] is None:
        return None, rec
    with torch.no_grad():
        for n in mods:
            u[n].copy_(best[2][n])
        new = {n: (w0[n] + u[n] * gain[n]).to(mods[n].weight.dtype) for n in mods}
        ws = {**fixed, **{f"{n}.weight": w for n, w in new.items()}}
        after = ((run_block(layer, xq, kw, micro, ws) - y) ** 2).mean().item()
    rec.update(norm_loss=after)
    return (new if after < rec["norm_start_loss"] else None), rec


def candidates(src: dict, s: dict, kv: dict, kt: dict | None, st: Settings) -> tuple[dict[str, dict], int]:
    """The block's decoded weights from its start ("start") and from the tuned (v, t) ("tuned"), module-relative
    names; and how many scale bytes the moves changed."""
    out: dict[str, dict] = {"start": {}, "tuned": {}}
    moved = 0
    with torch.no_grad():
        for n in src:
            tn = None if kt is None else kt[n]
            out["tuned"][n] = tuned.quantize(src[n], s[n], kv[n], tn, st.unit).dequantized
            out["start"][n] = tuned.quantize(src[n], s[n]).dequantized
            moved += int((tuned.scale_bytes(s[n], tn) != s[n].scale).sum())
    return out, moved


def heldout_losses(layer, cands: dict[str, dict], keep: str, held: tuple[torch.Tensor, dict]) -> tuple[dict, torch.Tensor]:
    """Each candidate's output MSE against the unquantized block on the held-out stream, and the kept one's outputs
    (the held-out stream's next inputs)."""
    xh, kwh = held
    micro = xh.shape[0]
    rec, nxt = {}, None
    with torch.no_grad():
        yh = run_block(layer, xh, kwh, micro)
        for name, ws in cands.items():
            out = run_block(layer, xh, kwh, micro, {f"{n}.weight": w for n, w in ws.items()})
            rec[f"heldout_{name}_loss"] = ((out - yh) ** 2).mean().item()
            if name == keep:
                nxt = out
    assert nxt is not None
    return rec, nxt


def gptq_fallback(layer, xq, y, kw, micro, st: Settings, squares, hess, cands: dict, rec: dict) -> str:
    """GPTQ of the block on the same inputs beside the tuned result (``st.fallback`` "gptq"): its weights join the
    candidates, its calibration loss the record; returns the candidate kept (the lowest calibration loss)."""
    gsrc, gs = starts(layer, st, squares, hess, init="gptq")
    zero = {n: torch.zeros_like(gsrc[n]) for n in gsrc}
    with torch.no_grad():
        rec["gptq_loss"] = block_loss(layer, xq, y, kw, micro, gsrc, gs, zero, None, st.unit).item()
        cands["gptq"] = {n: tuned.quantize(gsrc[n], gs[n]).dequantized for n in gsrc}
    mine = rec.get("tuned_loss", rec["start_loss"]) if rec.get("kept", "tuned") == "tuned" else rec["start_loss"]
    return "gptq" if rec["gptq_loss"] < mine else rec.get("kept", "tuned")


def quantize_model(bench: acc.Bench, tokens: torch.Tensor, st: Settings, device: torch.device, micro: int = 8,
                   max_blocks: int | None = None, heldout: bool = True) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Every block's linears tuned in model order (the module docstring's steps; the first ``max_blocks`` only,
    if given); returns the dequantized weights (checkpoint names) and one record per block. With ``heldout``,
    the evaluation text runs through the quantized blocks beside the calibration samples, and each block's
    output error on it is recorded for the start and the tuned weights (does the tuning generalise?). The
    model's weights are put back at the end."""
    model = bench.model.to(device)
    model.requires_grad_(False)
    layers = model.model.layers
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("model.layers.")}
    gen = torch.Generator().manual_seed(st.seed)
    out: dict[str, torch.Tensor] = {}
    records = []
    try:
        xq, kws = capture(model, layers, tokens.to(device), micro)
        xh, kwh = capture(model, layers, bench.ids.to(device), bench.ids.shape[0]) if heldout else (None, None)
        xf = xq.clone() if st.target == "fp" else None
        for i, layer in enumerate(layers[:max_blocks]):
            t0 = time.time()
            y, squares, hess = input_stats(layer, xq, kws[i], micro, "gptq" in (st.init, st.fallback))
            if xf is not None:
                with torch.no_grad():
                    y = xf = run_block(layer, xf, kws[i], micro)
            src, s = starts(layer, st, squares, hess)
            kv, kt, rec = tune_block(layer, xq, y, kws[i], micro, st, src, s, gen)
            cands, rec["scales_moved"] = candidates(src, s, kv, kt, st)
            keep = rec.get("kept", "tuned")
            if st.fallback == "gptq":
                keep = rec["kept"] = gptq_fallback(layer, xq, y, kws[i], micro, st, squares, hess, cands, rec)
            final = cands[keep]
            if st.norm_iters:
                new, nrec = tune_norms(layer, xq, y, kws[i], micro, st, final, gen)
                rec.update(nrec)
                if new is not None:
                    keep = "norms"
                    final = cands[keep] = {**final, **new}
            if xh is not None:
                more, xh = heldout_losses(layer, cands, keep, (xh, kwh[i]))
                rec.update(more)
            with torch.no_grad():
                mods = {**linears(layer), **norms(layer)}
                for n, w in final.items():
                    mods[n].weight.copy_(w.to(mods[n].weight.dtype))
                    out[f"model.layers.{i}.{n}.weight"] = w.float().cpu()
                xq = run_block(layer, xq, kws[i], micro)
            if device.type == "cuda":
                torch.cuda.synchronize()
            rec.update(block=i, seconds=round(time.time() - t0, 2),
                       step_gflop=round(block_flops(layer, st.batch * tokens.shape[1], tokens.shape[1], model.config) / 1e9, 2))
            records.append(rec)
            log.info("block %d: %s", i, {k: (round(v, 6) if isinstance(v, float) else v) for k, v in rec.items()})
    finally:
        with torch.no_grad():
            params = dict(model.named_parameters())
            for n, p in saved.items():
                params[n].copy_(p)
        bench.model.to("cpu")
    return out, records


def data_free(bench: acc.Bench, st: Settings) -> dict[str, torch.Tensor]:
    """The start without data (the rule's scales, no offsets): the data-free quantizer's weights, a check that
    this harness reproduces accuracy_gptq's ``rtn`` row."""
    params = dict(bench.model.named_parameters())
    out = {}
    for name in bench.linears:  # (every decoder linear; the head is not among them)
        w = params[name].detach().float()
        amax = None
        if SCHEMES[st.scheme].global_scale:
            mod = name[:-len(".weight")]
            group = next((g for g in FUSED for p in g if mod.endswith(p)), None)
            names = [mod.rsplit(".", 1)[0] + "." + p + ".weight" for p in group] if group else [name]
            amax = torch.stack([params[n].detach().float().abs().amax() for n in names]).amax()
        out[name] = tuned.quantize(w, tuned.start(w, st.scheme, st.rule, amax)).dequantized
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(acc.MODELS))
    p.add_argument("--scheme", default="mxfp4", choices=list(SCHEMES))
    p.add_argument("--rule", help="the start's scale rule (default: the scheme's default)")
    p.add_argument("--start-weights", default="none", choices=["none", "inputs"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--lr", type=float, help="offset rate (default 1 / iters)")
    p.add_argument("--scale-lr", type=float, default=0.0, help="scale-move rate (0: scales stay the rule's)")
    p.add_argument("--batch", type=int, default=8, help="samples per step")
    p.add_argument("--unit", default="step", choices=list(tuned.OFFSET_UNITS))
    p.add_argument("--target", default="same", choices=["same", "fp"])
    p.add_argument("--best", default="batch", choices=["batch", "last"])
    p.add_argument("--no-guard", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default="rtn", choices=["rtn", "gptq"], help="start from the rule's rounding or GPTQ's")
    p.add_argument("--fallback", default="none", choices=["none", "gptq"], help="GPTQ each block too; keep the lower loss")
    p.add_argument("--norm-iters", type=int, default=0, help="then tune the block's norm gains this many steps (0: not)")
    p.add_argument("--norm-lr", type=float, default=0.002)
    p.add_argument("--data-free", action="store_true", help="only the data-free start (a harness check)")
    p.add_argument("--blocks", type=int, help="tune only the first N blocks and record their losses (no KL): a proxy")
    p.add_argument("--no-heldout", action="store_true", help="do not carry the evaluation text's stream (per-block held-out losses)")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--calib-len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored (accuracy_gptq's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms (CUDA)")
    p.add_argument("--threads", type=int)
    p.add_argument("--cache", default=str(acc.DEFAULT_CACHE))
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import transformers

    transformers.logging.set_verbosity_error()
    if a.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    st = Settings(a.scheme, a.rule, a.start_weights, a.iters, a.lr, a.scale_lr, a.batch, a.unit, a.target, a.best,
                  not a.no_guard, a.seed, a.init, a.fallback, a.norm_iters, a.norm_lr)
    t0 = time.time()
    bench = acc.load_bench(a.model, a.tokens, 512, 4, Path(a.cache), threads=a.threads)
    _, _, tokens = agptq.calibration(bench.checkpoint, Path(a.cache) / a.model / "tuned", a.samples, a.calib_len)
    device = torch.device(a.device)
    t1 = time.time()
    if a.data_free:
        weights, records = data_free(bench, st), []
    else:
        weights, records = quantize_model(bench, tokens, st, device, max_blocks=a.blocks, heldout=not a.no_heldout)
    calib_s = time.time() - t1
    row = {"settings": asdict(st), "data_free": a.data_free, "calibrate_s": round(calib_s, 1), "blocks_tuned": a.blocks,
           **(acc.evaluate(bench, weights) if a.blocks is None else {}), "weight_rel_mse": acc.weight_mse(bench, weights),
           "blocks": records}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    row.update(command=" ".join(["python", "benchmarks/tuned_probe.py", *(argv if argv is not None else sys.argv[1:])]),
               commit=head, date=datetime.date.today().isoformat(), wall_s=round(time.time() - t0, 1),
               device=(torch.cuda.get_device_name() if device.type == "cuda" else
                       f"CPU ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"),
               load_avg_1m=round(os.getloadavg()[0], 2))
    path = Path(a.json)
    prev = json.loads(path.read_text()) if path.exists() else {"model": a.model, "base_ppl": bench.base_ppl,
                                                                "tokens": int(bench.ids.numel()), "rows": []}
    prev["rows"].append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prev, indent=1) + "\n")
    if "kl" in row:
        log.info("KL %.4f ppl %.3f top-1 %.4f (%s)", row["kl"], row["ppl"], row["top1"], json.dumps(asdict(st)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
