"""How torchrun ranks share a calibrated method's work (docs/numerics.md "GPTQ", "Under torchrun"): which rank
quantizes which of a block's matrices (:func:`owner_ranks`, the same split on every rank), the exchange of what
each rank quantized (:func:`exchange`: the stored bytes, dequantized exactly on every rank), and per-expert
statistics made every rank's (:func:`merged`). One process: nothing is exchanged."""

from __future__ import annotations

from fp4convert.calibrate.stats import Observers


class Owners(list):
    """A rank per matrix, and this process's rank."""

    rank = 0


def owner_ranks(mats: list, group) -> Owners:
    """Which torchrun rank sweeps each of ``mats`` ((decision, matrix, weights, prepared) each): a fused group's
    members together (they share a global scale), greedy by cost (N x K^2, the lazy update) to the least loaded rank,
    ties to the lower rank and the earlier matrix; deterministic from the matrices alone, so every rank computes the
    same split. One process: its own."""
    owners = Owners([0] * len(mats))
    if group is None or not group.distributed:
        return owners
    owners.rank = group.rank
    by_group: dict[str, list[int]] = {}
    for i, (d, m, _w, _p) in enumerate(mats):
        by_group.setdefault(m.group or d.group or m.module, []).append(i)
    cost = {g: sum(int(mats[i][2].shape[0]) * int(mats[i][2].shape[1]) ** 2 for i in idx) for g, idx in by_group.items()}
    load = [0] * group.size
    for g in sorted(by_group, key=lambda g: (-cost[g], by_group[g][0])):
        r = min(range(group.size), key=lambda r: (load[r], r))
        load[r] += cost[g]
        for i in by_group[g]:
            owners[i] = r
    return owners


def exchange(group, mine: dict, mats: list, amax: dict, scheme: str, global_scale: bool) -> dict:
    """The other ranks' results of ``mats`` (``mine``: index -> this rank's ``numerics.gptq.Result``), as the
    results their stored bytes decode to exactly (:func:`~fp4convert.calibrate.experts.dequantized`); ``amax``: each
    fused group's amax (every rank has them). Every rank must call it, even one that quantized them all."""
    import torch

    from fp4convert.calibrate.experts import Quantized, dequantized
    from fp4convert.numerics import gptq
    from fp4convert.numerics import reference as ref

    payload = {i: (r.packed.cpu(), r.scale.view(torch.uint8).cpu(), r.damp) for i, r in mine.items()}
    out = {}
    for got in group.gather(payload):
        for i, (packed, scale, damp) in got.items():
            if i in mine or i in out:
                continue
            d, m, w, _p = mats[i]
            a = amax[m.group or d.group or m.module] if global_scale else None
            packed, scale = packed.to(w.device), scale.to(w.device)
            values = dequantized(Quantized(packed, scale, None if a is None else float(a)), scheme, None)
            gs = None if a is None else ref.global_scale(a.to(torch.float32))
            out[i] = gptq.Result(packed, scale.view(torch.float8_e4m3fn) if gs is not None else scale, gs, values, damp)
    return out


def merged(group, per_key: dict, rotate: str | None) -> dict:
    """``per_key`` (key -> Observer, e.g. an expert's) with every torchrun rank's sums (one process: as it is)."""
    if group is None or not group.distributed:
        return per_key
    tmp = Observers(hessian=True, rotate=rotate)
    for k, o in per_key.items():
        tmp[str(k)] = o
    tmp.gather(group, [str(k) for k in per_key])
    return {int(n): o for n, o in tmp.items()}
