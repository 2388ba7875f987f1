"""Research harness for issue 22/24's scale-rule work: many rule variants, scored by KL in one process.

Not a product benchmark (benchmarks/accuracy.py and accuracy_w4a4.py are): it quantizes the model's
linears in-process with fast vectorized torch code (the existing rules reproduce the reference's
choices; new ideas are tried here before they go into the reference and the kernels), evaluates
mean next-token KL against the unquantized model per 512-token sequence (so paired differences and
the spread across text chunks are visible), and writes one JSON line per variant.

Variants are ``scheme:rule[:option=value,...]``:
  nvfp4 rules: max, 4over6, mse (candidates b6, b4, b6-1); options: w=none|gamma|calib|x2|gamma_x2|calib_x2
  (the block error's weight per element: the norm weight gamma_j^2 of the input channel for layers fed by
  a norm, the calibration E[x_j^2] (an oracle, not data-free), the weight's own x^2, or products),
  gs=<k> (global scale 2688/amax * 2^(-k/8)), gs=search (the k in 0..7 with the lowest total block
  error of the tensor, or fused group, under the rule), gs=1536 (the Four-over-Six paper's 256 * 6).
  mxfp4 rules: floor, peer (llm-compressor: up when the block max's mantissa >= 1.75), wmse, mse;
  same w= options.
  ``act=nvfp4`` evaluates W4A4 (activations quantized per 16-block under the calibrated static
  global scale, as engines run it); ``rot=had16`` rotates weights and (with act) activations.

    PYTHONPATH=. python benchmarks/probes/accuracy_explore.py --tokens 2048 nvfp4:max nvfp4:4over6:gs=search
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # benchmarks/: accuracy, accuracy_w4a4
from fp4convert.numerics import reference as ref  # noqa: E402

import accuracy as acc  # noqa: E402

F32 = torch.float32
NORM_OF = {"q_proj": "input_layernorm", "k_proj": "input_layernorm", "v_proj": "input_layernorm",
           "gate_proj": "post_attention_layernorm", "up_proj": "post_attention_layernorm"}


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """value(E2M1(y)) with sign, RNE, saturating at 6 (the reference's rounding)."""
    a = y.abs()
    step = (a.view(torch.int32) & 0x7F800000).view(F32) * 0.5
    step = step.clamp(0.5, 2.0)
    m = (a / step).round() * step
    return torch.copysign(m.clamp(max=6.0), y)


def nv_deq(blocks: torch.Tensor, gs: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    sf = ref.e4m3_decode(c)
    r = torch.where(sf > 0, torch.clamp(gs / sf, max=ref.FLT_MAX), torch.zeros_like(sf))
    return e2m1_round(blocks * r[..., None]) * (sf / gs)[..., None]


def werr(blocks, deq, w):
    e = (deq - blocks) ** 2
    if w is not None:
        e = e * w
    return e.sum(-1)


def nv_choose(blocks, gs, rule, w):
    """(deq blocks, total error) under ``rule`` with element weights w (broadcast to blocks) or None."""
    s = gs * blocks.abs().amax(-1)
    b6 = ref.e4m3_encode(s / 6.0)
    if rule == "max":
        d = nv_deq(blocks, gs, b6)
        return d, werr(blocks, d, w).sum()
    b4 = ref.e4m3_encode(s / 4.0)
    cands = [b6, b4]
    if rule == "mse":
        cands.append((b6.int() - 1).clamp(min=0).to(torch.uint8))
    if rule == "mse5":  # wider search: b6-1, b6+1 as well
        cands += [(b6.int() - 1).clamp(min=0).to(torch.uint8), (b6.int() + 1).clamp(max=0x7E).to(torch.uint8),
                  (b4.int() + 1).clamp(max=0x7E).to(torch.uint8)]
    best_d = nv_deq(blocks, gs, cands[0])
    best_e = werr(blocks, best_d, w)
    for c in cands[1:]:
        d = nv_deq(blocks, gs, c)
        e = werr(blocks, d, w)
        take = e < best_e
        best_d = torch.where(take[..., None], d, best_d)
        best_e = torch.where(take, e, best_e)
    return best_d, best_e.sum()


def mx_choose(blocks, rule, w):
    bmax = blocks.abs().amax(-1)
    e = ref.e8m0_encode_from_bmax(bmax).int()

    def deq(ex):
        return e2m1_round(blocks * ref.pow2_f32(127 - ex)[..., None]) * ref.pow2_f32(ex - 127)[..., None]

    if rule == "floor":
        return deq(e)
    up = (e + 1).clamp(max=254)
    if rule == "peer":
        return deq(torch.where(bmax * ref.pow2_f32(127 - e) >= 7.0, up, e))
    d0, d1 = deq(e), deq(up)
    ww = w
    if rule == "wmse":
        ww = blocks**2 if w is None else w * blocks**2
    take = werr(blocks, d1, ww) < werr(blocks, d0, ww)
    return torch.where(take[..., None], d1, d0)


class Quantizer:
    def __init__(self, bench: acc.Bench, calib_sq: dict[str, torch.Tensor] | None, rand_sq=None):
        self.bench = bench
        self.params = dict(bench.model.named_parameters())
        self.calib_sq = calib_sq or {}
        self.rand_sq = rand_sq or {}

    def col_weights(self, name: str, kind: str, rot: str | None) -> torch.Tensor | None:
        """Per-input-channel weight [K] for the block error, or None."""
        base = kind.replace("_x2", "")
        if base in ("none", "x2"):
            return None
        mod = name[: -len(".weight")]
        typ = mod.split(".")[-1]
        if base == "gamma":
            if typ not in NORM_OF:
                return None
            layer = mod.rsplit(".", 2)[0]
            norm = NORM_OF[typ]
            if typ in ("gate_proj", "up_proj") and f"{layer}.pre_feedforward_layernorm.weight" in self.params:
                norm = "pre_feedforward_layernorm"  # Gemma: post_attention_layernorm is on the attention output
            mods = dict(self.bench.model.named_modules())
            with torch.no_grad():  # the norm's effective per-channel gain (Gemma's is 1 + w): norm(ones)
                g = mods[f"{layer}.{norm}"](torch.ones(1, self.params[name].shape[1])).reshape(-1).float()
            v = g * g
        elif base == "calib":
            v = self.calib_sq[mod]
        elif base == "rand":
            v = self.rand_sq[mod]
        else:
            raise ValueError(kind)
        if rot == "had16":  # a diagonal weight does not survive the rotation; use the block mean
            v = v.reshape(-1, 16).mean(-1, keepdim=True).expand(-1, 16).reshape(-1)
        return v / v.mean()

    def weights(self, scheme: str, rule: str, opts: dict[str, str]) -> dict[str, torch.Tensor]:
        rot = opts.get("rot")
        wkind = opts.get("w", "none")
        out = {}
        for group in acc.fused_groups(self.bench.linears):
            ws = [self.params[n].detach().float() for n in group]
            if rot == "had16":
                ws = [ref.had16(w) for w in ws]
            bl = [w.reshape(w.shape[0], -1, 16 if scheme == "nvfp4" else 32) for w in ws]
            wts = []
            for n, b in zip(group, bl):
                cw = self.col_weights(n, wkind, rot)
                wt = None if cw is None else cw.reshape(1, b.shape[1], b.shape[2])
                if wkind.endswith("x2") or wkind == "x2":
                    wt = b**2 if wt is None else wt * b**2
                wts.append(wt)
            if scheme == "nvfp4":
                amax = torch.stack([w.abs().amax() for w in ws]).amax()
                gs0 = ref.global_scale(amax)
                g = opts.get("gs", "0")
                if g == "search":
                    ks = range(0, 8)
                elif g == "1536":
                    ks = [None]
                else:
                    ks = [int(g)]
                best = None
                for k in ks:
                    gs = (torch.tensor(1536.0) / amax) if k is None else gs0 * 2.0 ** (-k / 8)
                    res = [nv_choose(b, gs, rule, wt) for b, wt in zip(bl, wts)]
                    tot = sum(r[1] for r in res)
                    if best is None or tot < best[0]:
                        best = (tot, [r[0] for r in res], k)
                deqs = best[1]
            else:
                deqs = [mx_choose(b, rule, wt) for b, wt in zip(bl, wts)]
            for n, w, d in zip(group, ws, deqs):
                d = d.reshape(w.shape)
                out[n] = ref.inverse_had16(d) if rot == "had16" else d
        return out


def per_seq_eval(bench: acc.Bench, weights, act_quant=None) -> dict:
    kls, nll, agree, count = [], 0.0, 0.0, 0
    with acc.swapped(bench, weights, act_quant) as model, torch.inference_mode():
        for x, base in zip(bench.ids.split(bench.batch), bench.base_logprobs):
            lp = torch.log_softmax(model(x).logits[:, :-1].float(), dim=-1)
            nll -= lp.gather(-1, x[:, 1:, None]).sum().item()
            kls += (base.exp() * (base - lp)).sum(-1).mean(-1).tolist()
            agree += (base.argmax(-1) == lp.argmax(-1)).sum().item()
            count += x[:, 1:].numel()
    return {"kl": sum(kls) / len(kls), "kl_seq": kls, "ppl": math.exp(nll / count), "top1": agree / count}


def calibration_stats(bench: acc.Bench, cache: Path, samples: int, seq_len: int, source: str = "file") -> tuple[dict, dict, dict]:
    """Per linear input: E[x_j^2] [K], amax, and amax of Had16(x), on the stdlib-docstring calibration tokens
    (the W4A4 benchmark's file, the same token windows llm-compressor's oneshot gets)."""
    f = cache / f"calib_{source}_{samples}x{seq_len}.pt"
    if f.exists():
        return torch.load(f)
    import accuracy_w4a4 as w4
    from transformers import AutoTokenizer

    from fp4convert.calibrate import file_tokens

    if source == "rand":  # data-free: uniformly random token ids, seeded
        vocab = bench.model.get_input_embeddings().weight.shape[0]
        calib = torch.randint(0, vocab, (samples, seq_len), generator=torch.Generator().manual_seed(0))
    else:
        data = w4.stdlib_docstrings(cache / "calibration.txt")
        tok = AutoTokenizer.from_pretrained(bench.checkpoint)
        calib = file_tokens(tok, data, samples, seq_len)
    sq, amax, amax_r, cnt = {}, {}, {}, {}
    mods = dict(bench.model.named_modules())
    hooks = []
    for w in bench.linears:
        n = w[: -len(".weight")]

        def hook(m, a, _n=n):
            x = a[0].detach().float().reshape(-1, a[0].shape[-1])
            sq[_n] = sq.get(_n, 0) + (x * x).sum(0)
            cnt[_n] = cnt.get(_n, 0) + x.shape[0]
            amax[_n] = max(amax.get(_n, 0.0), x.abs().amax().item())
            amax_r[_n] = max(amax_r.get(_n, 0.0), ref.had16(x).abs().amax().item())
        hooks.append(mods[n].register_forward_pre_hook(hook))
    with torch.inference_mode():
        for x in calib.split(4):
            bench.model(x)
    for h in hooks:
        h.remove()
    res = ({n: sq[n] / cnt[n] for n in sq}, amax, amax_r)
    torch.save(res, f)
    return res


def shared(amax: dict[str, float], names) -> dict[str, torch.Tensor]:
    """Fused groups at their max (what the converter stores), as encode scales 2688 / amax."""
    out = {}
    for group in acc.fused_groups(tuple(names)):
        mods = [g[: -len(".weight")] for g in group]
        a = max(amax[m] for m in mods)
        for m in mods:
            out[m] = ref.global_scale(torch.tensor(a, dtype=F32))
    return out


def act_hook(scales: dict[str, torch.Tensor], rot: str | None):
    import accuracy_w4a4 as w4

    def hook(name, x):
        if rot == "had16":
            return ref.inverse_had16(w4.nvfp4_act(ref.had16(x.float()), scales[name])).to(x.dtype)
        return w4.nvfp4_act(x, scales[name])
    return hook


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("variants", nargs="+")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--calib-len", type=int, default=256)
    p.add_argument("--out", default="/tmp/explore.jsonl")
    p.add_argument("--dither", action="store_true")
    args = p.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    t0 = time.time()
    cache = acc.DEFAULT_CACHE / (args.model + ("-dither" if args.dither else ""))
    cache.mkdir(parents=True, exist_ok=True)
    bench = acc.load_bench(args.model, args.tokens, 512, 4, dither=args.dither)
    print(f"loaded {time.time() - t0:.0f}s base ppl {bench.base_ppl:.3f}", flush=True)
    need_calib = any("calib" in v or "act=" in v for v in args.variants)
    stats = calibration_stats(bench, cache, args.samples, args.calib_len) if need_calib else ({}, {}, {})
    rstats = calibration_stats(bench, cache, args.samples, args.calib_len, "rand") if any("rand" in v for v in args.variants) else ({},)
    q = Quantizer(bench, stats[0], rstats[0])
    for v in args.variants:
        t = time.time()
        parts = v.split(":")
        scheme, rule = parts[0], parts[1]
        opts = dict(kv.split("=") for kv in parts[2:]) if len(parts) > 2 else {}
        w = q.weights(scheme, rule, opts)
        hook = None
        if opts.get("act") == "nvfp4":
            rot = opts.get("rot")
            hook = act_hook(shared(stats[2] if rot == "had16" else stats[1], bench.linears), rot)
        r = per_seq_eval(bench, w, hook)
        row = {"variant": v, "model": args.model, "dither": args.dither, "tokens": int(bench.ids.numel()), **r,
               "s": round(time.time() - t, 1)}
        print(json.dumps({k: (round(x, 5) if isinstance(x, float) else x) for k, x in row.items() if k != "kl_seq"}),
              [round(x, 4) for x in r["kl_seq"]], flush=True)
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
