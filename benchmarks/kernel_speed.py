"""Kernel throughput on the GPU: each pass beside the device-to-device copy and the peers.

For 8192x8192 and 16384x16384 bf16 it prints, per pass: median time (triton.testing.do_bench,
which flushes L2 between repetitions), GB/s counting docs/numerics.md's bytes, and % of the copy bandwidth
measured in the same run. Then:
- the scale-rule table (NVFP4 max / 4over6 / mse / wmse, MXFP4 floor / rceil / mse / wmse, plain and Had16): time,
  % of copy, and the ratio to the plain rule (issue 13's target: <= 1.5x at 16384^2 on the H100);
- the input decode kernels (fp8 block / per-row scaled, gpt-oss mxfp4 blocks -> fp32), GB/s vs copy;
- the public-API overhead rows (issue 10): ``fp4convert.quantize(x, "nvfp4", global_amax=a)`` against
  the bare kernel, and the two-pass public call (amax + quantize + the flag's host sync) against the
  two kernels back to back; both sides timed alike (wall clock per call over rotating inputs, the
  public side including its host work and sync).
Peers: torch.compile of the reference (NVFP4 with the global amax given, MXFP4), and fouroversix's
Triton NVFP4 quantizer when its wheel is installed. Each peer's bytes are compared with ours
(exact-match share) so a fast-but-different peer is visible as such.

    python benchmarks/kernel_speed.py [--sizes 8192 16384] [--json out.json] [--no-peers]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fp4convert  # noqa: E402
from fp4convert.numerics import reference as ref  # noqa: E402
from fp4convert.kernels.cuda import ops  # noqa: E402

log = logging.getLogger("bench")


def bench(fn: Callable[[], object], reps: int = 100) -> float:
    """Median milliseconds (do_bench when Triton is there, else CUDA events with an L2 flush)."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=50, rep=reps * 2, return_mode="median"))
    except ImportError:
        flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        for _ in range(5):
            fn()
        times = []
        for _ in range(reps):
            flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)


_FLUSH: dict[str, torch.Tensor] = {}


def bench_clean(fn: Callable[[], object], reps: int = 60) -> float:
    """Median ms with L2 flushed by *reading* 256 MB, so it holds no dirty lines.

    do_bench flushes by zeroing 256 MB, which leaves up to 50 MB of dirty lines in L2 that the timed
    kernel then pays to write back: a fixed ~10 us penalty that weighs most on the smallest,
    read-mostly passes. Reported beside do_bench, never instead of it.
    """
    if "buf" not in _FLUSH:
        _FLUSH["buf"] = torch.ones(64 << 20, dtype=torch.float32, device="cuda")
        _FLUSH["dst"] = torch.empty((), dtype=torch.float32, device="cuda")
    buf, dst = _FLUSH["buf"], _FLUSH["dst"]
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        torch.amax(buf, dim=0, out=dst)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_steady(fns: list[Callable[[], object]], rounds: int = 5, trials: int = 7) -> float:
    """Median ms per call of back-to-back calls, rotating over input sets larger than L2 together.

    No flush: each call inherits the previous call's dirty lines, as in a conversion pipeline. The launch
    latency hides behind the previous call's execution.
    """
    for f in fns:
        f()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(rounds):
            for f in fns:
                f()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / (rounds * len(fns)))
    return statistics.median(times)


def bench_wall(fns: list[Callable[[], object]], rounds: int = 5, trials: int = 7) -> float:
    """Median wall-clock ms per call of back-to-back calls over rotating inputs, host work included.

    For the public-API rows, whose calls synchronize with the host (the non-finite flag): the bare
    kernels they are compared with are timed the same way, with one synchronize at the end.
    """
    for f in fns:
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(rounds):
            for f in fns:
                f()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / (rounds * len(fns)))
    return statistics.median(times)


def match(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of identical bytes (1.0 = bit-exact)."""
    a, b = a.contiguous().view(torch.uint8).reshape(-1), b.contiguous().view(torch.uint8).reshape(-1)
    if a.numel() != b.numel():
        return float("nan")
    return float((a == b).float().mean())


def run(size: int, rows: list[dict], peers: bool, api_only: bool = False) -> None:
    n = size * size
    x = (torch.randn(1, size, size, device="cuda") * torch.exp(torch.empty(1, size, 1, device="cuda").uniform_(-3, 3)))
    x = x.to(torch.bfloat16)
    copy_dst = torch.empty_like(x)
    copy_ms = bench(lambda: copy_dst.copy_(x))
    copy_bw = 4 * n / copy_ms / 1e6  # GB/s, read + write
    amax = ops.amax(x, None)
    gs = ref.global_scale(amax)
    amax_r = ops.amax(x, "had16")

    copy_clean = bench_clean(lambda: copy_dst.copy_(x))
    copy_bw_clean = 4 * n / copy_clean / 1e6
    # Rotating input sets for the steady-state column (4 x the input, well over the 50 MB L2).
    xs = [x] + [x.clone() for _ in range(3)]
    dsts = [torch.empty_like(x) for _ in xs]
    copy_steady = bench_steady([lambda i=i: dsts[i].copy_(xs[i]) for i in range(len(xs))])
    copy_bw_steady = 4 * n / copy_steady / 1e6
    del dsts

    def add(name: str, ms: float, nbytes: float, note: str = "", fn=None) -> None:
        """fn: a callable of the input-set index (0..3), for the clean-flush and steady-state columns."""
        bw = nbytes / ms / 1e6
        row = {"size": size, "pass": name, "ms": ms, "GB/s": bw, "%copy": 100 * bw / copy_bw, "note": note}
        if fn is not None:
            ms_c = bench_clean(lambda: fn(0))
            ms_s = bench_steady([lambda i=i: fn(i) for i in range(len(xs))])
            row.update({"ms_clean": ms_c, "%copy_clean": 100 * (nbytes / ms_c / 1e6) / copy_bw_clean,
                        "ms_steady": ms_s, "%copy_steady": 100 * (nbytes / ms_s / 1e6) / copy_bw_steady})
        rows.append(row)
        log.info("%5d  %-46s %8.3f ms %8.0f GB/s %6.1f %%  clean-flush %s  steady %s  %s", size, name, ms, bw,
                 100 * bw / copy_bw, f"{row['%copy_clean']:.1f} %" if fn else "-",
                 f"{row['%copy_steady']:.1f} %" if fn else "-", note)

    def timed(name: str, fn, nbytes: float, note: str = "") -> None:
        add(name, bench(lambda: fn(0)), nbytes, note, fn)

    wdst = torch.empty_like(x)
    add("[ref] write-only memset of 2N bytes", bench(lambda: wdst.zero_()), 2 * n, "the write floor of dequantize")
    del wdst
    rows.append({"size": size, "pass": "device-to-device copy (read+write)", "ms": copy_ms, "GB/s": copy_bw,
                 "%copy": 100.0, "note": "", "ms_clean": copy_clean, "%copy_clean": 100.0,
                 "ms_steady": copy_steady, "%copy_steady": 100.0})
    log.info("%5d  copy %.3f ms (%.0f GB/s), clean-flush %.3f ms (%.0f GB/s), steady %.3f ms (%.0f GB/s)", size,
             copy_ms, copy_bw, copy_clean, copy_bw_clean, copy_steady, copy_bw_steady)
    if api_only:
        public_api(size, xs, amax, add)
        return
    rd, nv_out, mx_out = 2 * n, n / 2 + n / 16, n / 2 + n / 32
    timed("amax", lambda i: ops.amax(xs[i], None), rd)
    timed("amax had16", lambda i: ops.amax(xs[i], "had16"), rd)
    timed("nvfp4 quantize (amax given)", lambda i: ops.quantize(xs[i], "nvfp4", amax, None, False), rd + nv_out)
    timed("nvfp4 quantize swizzled", lambda i: ops.quantize(xs[i], "nvfp4", amax, None, True), rd + nv_out)
    timed("nvfp4 quantize had16 (amax given)", lambda i: ops.quantize(xs[i], "nvfp4", amax_r, "had16", False),
          rd + nv_out)
    timed("mxfp4 quantize", lambda i: ops.quantize(xs[i], "mxfp4", None, None, False), rd + mx_out)
    timed("mxfp4 quantize had16", lambda i: ops.quantize(xs[i], "mxfp4", None, "had16", False), rd + mx_out)
    p, s, _, _ = ops.quantize(x, "nvfp4", amax, None, False)
    pm, sm, _, _ = ops.quantize(x, "mxfp4", None, None, False)
    qn = [ops.quantize(xi, "nvfp4", amax, None, False) for xi in xs]
    qr = [ops.quantize(xi, "nvfp4", amax_r, "had16", False) for xi in xs]
    qm = [ops.quantize(xi, "mxfp4", None, None, False) for xi in xs]
    timed("nvfp4 dequantize -> bf16",
          lambda i: ops.dequantize(qn[i][0], qn[i][1], qn[i][2], "nvfp4", None, False, torch.bfloat16), nv_out + 2 * n)
    timed("nvfp4 dequantize had16 -> bf16",
          lambda i: ops.dequantize(qr[i][0], qr[i][1], qr[i][2], "nvfp4", "had16", False, torch.bfloat16),
          nv_out + 2 * n)
    timed("mxfp4 dequantize -> bf16",
          lambda i: ops.dequantize(qm[i][0], qm[i][1], None, "mxfp4", None, False, torch.bfloat16), mx_out + 2 * n)
    del qn, qr, qm
    scale_rules(size, xs, amax, amax_r, add, rows)
    decoders(size, add)
    public_api(size, xs, amax, add)
    if not peers:
        return
    # Peers ---------------------------------------------------------------------------------------
    x2 = x[0]
    try:
        comp = torch.compile(lambda t, a: ref.nvfp4_quantize(t, a))
        cp, cs, _ = comp(x2, amax[0])
        note = f"bytes = ours: packed {match(cp, p[0]):.5f}, scales {match(cs, s[0]):.5f}"
        timed("peer: torch.compile(reference) nvfp4", lambda i: comp(xs[i][0], amax[0]), rd + nv_out, note)
    except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
        log.warning("torch.compile nvfp4 peer failed: %s", exc)
    try:
        compm = torch.compile(lambda t: ref.mxfp4_quantize(t))
        cp, cs = compm(x2)
        note = f"bytes = ours: packed {match(cp, pm[0]):.5f}, scales {match(cs, sm[0]):.5f}"
        timed("peer: torch.compile(reference) mxfp4", lambda i: compm(xs[i][0]), rd + mx_out, note)
    except Exception as exc:  # noqa: BLE001
        log.warning("torch.compile mxfp4 peer failed: %s", exc)
    try:
        if torch.cuda.get_device_capability()[0] < 10:
            raise RuntimeError("fouroversix 0.1.0's Triton kernel emits cvt.e2m1x2 (ptxas rejects it below sm_100)")
        from fouroversix.quantize import triton_kernel as fos
        from fouroversix.utils import AdaptiveBlockScalingRule

        # Its norm constant plays our gs's role; always_6 is plain NVFP4 scaling.
        fe, fsf, _ = fos.quantize_to_fp4(x2, gs.reshape(1), scale_rule=AdaptiveBlockScalingRule.always_6)
        note = f"packed bytes = ours {match(fe[:size, : size // 2], p[0]):.5f} (its rounding/layout rules differ)"
        add("peer: fouroversix Triton nvfp4 (gs given)",
            bench(lambda: fos.quantize_to_fp4(x2, gs.reshape(1), scale_rule=AdaptiveBlockScalingRule.always_6)),
            rd + nv_out, note)
    except Exception as exc:  # noqa: BLE001
        log.warning("fouroversix peer unavailable: %s: %s", type(exc).__name__, str(exc)[:300])


RULES = {"nvfp4": ("max", "4over6", "mse", "wmse"), "mxfp4": ("floor", "rceil", "mse", "wmse")}


def scale_rules(size: int, xs: list[torch.Tensor], amax, amax_r, add, rows: list[dict]) -> None:
    """Every scale rule, plain and Had16: do_bench time, % of copy, and the ratio to the plain rule."""
    n = size * size
    for scheme in ("nvfp4", "mxfp4"):
        out = n / 2 + n / (16 if scheme == "nvfp4" else 32)
        for rotate in (None, "had16"):
            am = None if scheme == "mxfp4" else (amax if rotate is None else amax_r)
            base = None
            for code, rule in enumerate(RULES[scheme]):
                ms = bench(lambda: ops.quantize(xs[0], scheme, am, rotate, False, code))
                base = base or ms
                note = f"{ms / base:.2f}x the {RULES[scheme][0]} rule"
                add(f"rule: {scheme} {rule}{' had16' if rotate else ''}", ms, 2 * n + out, note)
                rows[-1]["rule_ratio"] = ms / base


def decoders(size: int, add) -> None:
    """Input decode kernels -> fp32 (bytes: input + scales read, 4 B/element written)."""
    n = size * size
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randint(0, 256, (size, size), device="cuda", dtype=torch.uint8, generator=gen)
    w[(w & 0x7F) == 0x7F] = 0
    w8 = w.view(torch.float8_e4m3fn)
    sb = torch.rand(size // 128, size // 128, device="cuda", generator=gen) + 0.5
    add("decode fp8_block 128x128 -> fp32", bench(lambda: ops.decode_fp8_block(w8, sb, (128, 128))), 5 * n)
    sr = torch.rand(size, 1, device="cuda", generator=gen) + 0.5
    add("decode fp8_scaled per-row -> fp32", bench(lambda: ops.decode_fp8_scaled(w8, sr)), 5 * n)
    blocks = w.reshape(-1)[: n // 2].reshape(size, size // 32, 16)  # K/2 bytes of codes per row
    scales = torch.randint(100, 140, (size, size // 32), device="cuda", dtype=torch.uint8, generator=gen)
    add("decode mxfp4_blocks (gpt-oss) -> fp32", bench(lambda: ops.decode_mxfp4_blocks(blocks, scales)),
        n / 2 + n / 32 + 4 * n)


def public_api(size: int, xs: list[torch.Tensor], amax, add) -> None:
    """Issue 10's rows: the public API against the bare kernels, both timed with bench_wall."""
    n = size * size
    nbytes = 2 * n + n / 2 + n / 16
    a = amax[0]  # a device scalar, as a fused group's amax would be
    try:
        bare = bench_wall([lambda i=i: ops.quantize(xs[i], "nvfp4", amax, None, False) for i in range(len(xs))])
        from fp4convert.kernels.cuda import api_ext

        glue = api_ext.wait()  # the C++ glue built (or found) before timing
        saved = api_ext._state.get("module")
        api_ext._state["module"] = None  # the Python path first
        api_py = bench_wall([lambda i=i: fp4convert.quantize(xs[i][0], "nvfp4", global_amax=a) for i in range(len(xs))])
        api_ext._state["module"] = saved
        add("api (Python path): fp4convert.quantize, global_amax=a", api_py, nbytes, f"{100 * bare / api_py:.0f}% of bare kernel")
        api = bench_wall([lambda i=i: fp4convert.quantize(xs[i][0], "nvfp4", global_amax=a) for i in range(len(xs))])
        add(f"api: fp4convert.quantize(x, 'nvfp4', global_amax=a){'' if glue else ' [no glue]'}", api, nbytes,
            f"{100 * bare / api:.0f}% of bare kernel")
        add("api: bare ops.quantize (amax given), wall clock", bare, nbytes, "issue 10: api >= 90% of copy")
        # The bare two-pass baseline: the amax kernel, then quantize with that amax (ops.quantize's own
        # amax=None path would run the amax pass a second time).
        two = bench_wall([lambda i=i: ops.quantize(xs[i], "nvfp4", ops.amax(xs[i], None), None, False)
                          for i in range(len(xs))])
        api2 = bench_wall([lambda i=i: fp4convert.quantize(xs[i][0], "nvfp4") for i in range(len(xs))])
        add("api: fp4convert.quantize(x, 'nvfp4') two-pass + flag sync", api2, nbytes + 2 * n,
            f"{100 * two / api2:.0f}% of the two kernels (target >= 85%)")
        add("api: amax + quantize kernels back to back, wall clock", two, nbytes + 2 * n)
        # Per-call host cost, on a tiny matrix where the kernel is ~nothing: what a call adds to the
        # kernel's time (the sync makes it exposed, not overlapped).
        tiny = [torch.randn(128, 256, device="cuda").to(torch.bfloat16) for _ in range(4)]
        ta = torch.ones((), device="cuda")
        t_api = bench_wall([lambda i=i: fp4convert.quantize(tiny[i], "nvfp4", global_amax=ta) for i in range(4)], 50)
        t_ops = bench_wall([lambda i=i: ops.quantize(tiny[i], "nvfp4", ta, None, False, host_flag=True)[3]()
                            for i in range(4)], 50)
        t_launch = bench_wall([lambda i=i: ops.quantize(tiny[i], "nvfp4", ta, None, False) for i in range(4)], 50)
        t_sync = bench_wall([lambda: torch.cuda.current_stream().synchronize()], 50)
        for label, t in (("public API call", t_api), ("ops.quantize + mapped flag + stream sync", t_ops),
                         ("ops.quantize, device flag, no sync", t_launch), ("stream sync alone", t_sync)):
            add(f"api overhead: {label} on 128x256", t, 0, f"{1000 * t:.1f} us per call")
    except Exception as exc:  # noqa: BLE001 - e.g. tensor.py not yet on the new ops signature
        log.warning("public-API rows failed: %s: %s", type(exc).__name__, str(exc)[:300])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--api-only", action="store_true", help="only the public-API rows (issue 10), ~20 s")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # the reference's graph breaks are expected
    props = torch.cuda.get_device_properties(0)
    log.info("device: %s, %d SMs, torch %s", props.name, props.multi_processor_count, torch.__version__)
    rows: list[dict] = []
    # Fixed GPU cost of one call, from a 16x16 input: launches, the flag/amax zeroing, ramp-up.
    tiny = torch.randn(1, 16, 16, device="cuda").to(torch.bfloat16)
    tamax = ops.amax(tiny, None)
    tdst = torch.empty_like(tiny)
    for name, fn in [("copy", lambda: tdst.copy_(tiny)), ("amax", lambda: ops.amax(tiny, None)),
                     ("nvfp4 quantize", lambda: ops.quantize(tiny, "nvfp4", tamax, None, False))]:
        log.info("fixed cost per call (16x16 input), %s: %.1f us", name, 1000 * bench(fn))
    for size in args.sizes:
        run(size, rows, not args.no_peers, args.api_only)
        torch.cuda.empty_cache()
    log.info("\n| size | pass | ms | GB/s | % of copy | clean-flush ms | clean-flush % of copy | steady ms "
             "| steady % of copy | note |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        clean = (f"{r['ms_clean']:.3f} | {r['%copy_clean']:.1f} | {r['ms_steady']:.3f} | {r['%copy_steady']:.1f}"
                 if "ms_clean" in r else "- | - | - | -")
        log.info("| %d | %s | %.3f | %.0f | %.1f | %s | %s |", r["size"], r["pass"], r["ms"], r["GB/s"], r["%copy"],
                 clean, r["note"])
    if args.json:
        args.json.write_text(json.dumps({"device": props.name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
