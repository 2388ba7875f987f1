"""An inspect report as a person reads it: the text report, the errors-only lines of ``-q``, and the per-layer
error chart of ``--verify --plot``."""

from __future__ import annotations

from html import escape

from fp4convert.checkpoint.inspect import describe_input_weights
from fp4convert.checkpoint.verify import NOT_QUANTIZED, OK
from fp4convert.config import human_bytes
from fp4convert.output.describe import describe_activations, describe_method


def render(r: dict) -> list[str]:
    """The report as the lines ``fp4convert inspect`` prints."""
    lines = []
    if r["verdict"] == NOT_QUANTIZED:
        lines.append(f"{r['path']}: not quantized (no FP4 weights; {r['kept']} tensors, {human_bytes(r['bytes'])}, "
                     f"{r['params']:,} params, {r['bits_per_param']} bits/param)")
    else:
        lines.append(f"{r['path']}: format {r['format']}, scheme {r['scheme']}, rotation {r['rotate'] or 'none'}"
                     + (f", scale rule {r['scale_rule']}" if r.get("scale_rule") else ""))
        lines.append(f"  activations: {describe_activations(r.get('activations'))}")
        lines.append(f"  weights: {weights_line(r)}")
        if r.get("input_weights"):
            lines.append(f"  input weights: {describe_input_weights(r['input_weights'])}")
        acts = f", {r['activation_scales']} activation scales" if r.get("activation_scales") else ""
        lines.append(
            f"  {r['quantized']} quantized weights{acts}, {r['kept']} kept tensors, {r['fused_groups']} fused groups; "
            f"{human_bytes(r['bytes'])}, {r['params']:,} params, {r['bits_per_param']} bits/param "
            f"({r['bits_per_param_quantized']} in quantized layers)")
    lines.append(f"  {'layer':<28} {'quantized':>9} {'kept':>5} {'size':>10}")
    for name, row in r["layers"].items():
        lines.append(f"  {name:<28} {row['quantized']:>9} {row['kept']:>5} {human_bytes(row['bytes']):>10}")
    c = r["checks"]
    for note in c.get("notes", []):
        lines.append(f"  note: {note}")
    if r["verdict"] != NOT_QUANTIZED:
        lines.append(f"  manifest: {c['manifest']}; engine config: {c['engine_config']}")
        lines.append(f"  files: {c['checksums']}; block scales "
                     f"{'checked' if c['block_scales_checked'] else 'not read (use --check-files)'}")
    v = r.get("verify")
    if v:
        lines += verify_lines(v)
    problems = c["problems"]
    if problems:
        lines.append(f"  {len(problems)} problem(s):")
        lines += [f"    - {p}" for p in problems]
    for w in r.get("warnings", []):
        lines.append(f"  warning: {w}")
    if r["verdict"] == OK:
        lines.append("  verdict: OK" + (" (verified against the source)" if v else "")
                     + (f", with {len(r['warnings'])} warning(s) above" if r.get("warnings") else ""))
    elif r["verdict"] == NOT_QUANTIZED:
        lines.append("  verdict: NOT QUANTIZED (nothing to check; inspect expects an FP4 checkpoint)")
    else:
        lines.append(f"  verdict: FAILED ({len(problems)} problem(s))")
    return lines


def weights_line(r: dict) -> str:
    """How the weights were rounded, for every output: the manifest's method record (a calibrated method),
    round-to-nearest (data-free, or with measured input weights), or unknown without a manifest."""
    if r["checks"]["manifest"] != "present":
        return "how they were rounded is not recorded (no fp4convert manifest)"
    return describe_method({"method": r.get("method"), "identity": {"input_weights": r.get("input_weights")}})


def verify_lines(v: dict) -> list[str]:
    """``--verify``'s part of the report: each layer's error beside round-to-nearest's on the same weights,
    in layer order, the failing ones flagged, and the criterion they were judged by."""
    from fp4convert.checkpoint.verify import Criterion

    judge = Criterion(v.get("method", "rtn"), False, v.get("max_error"), v.get("max_ratio"))
    lines = [f"  verify against {v['source']} (source fingerprint: {v['fingerprint']}):"]
    for m, e in v["layers"].items():
        if "error" in e:
            lines.append(f"    {m}: {e['error']}")
        else:
            flag = "".join(f"  > {limit}" for limit in judge.over(e))
            lines.append(f"    {m:<44} rel.err {e['rel_error']:.4f}  SNR {e['snr_db']:5.1f} dB  "
                         f"{e['vs_rtn']:5.2f} x rtn {e['rtn_rel_error']:.4f}{flag}")
    o = v["overall"]
    if o:
        lines.append(f"    overall: mean rel.err {o['mean_rel_error']:.4f}, worst {o['worst_rel_error']:.4f} "
                     f"({o['worst_layer']}), worst {o['worst_vs_rtn']:.2f} x round-to-nearest "
                     f"({o['worst_vs_rtn_layer']}), SNR {o['snr_db']:.1f} dB over {o['layers']} layers")
    lines.append(f"    criterion ({v.get('method', 'rtn')} weights): every layer's {v['criterion']}")
    return lines


def render_errors(r: dict) -> list[str]:
    """What ``inspect --quiet`` prints (errors only): nothing for a sound checkpoint, else one ``Error:``
    line with the verdict and the problems below it."""
    if r["verdict"] == OK:
        return []
    if r["verdict"] == NOT_QUANTIZED:
        return [f"Error: {r['path']}: not quantized (no FP4 weights; inspect expects an FP4 checkpoint)"]
    problems = r["checks"]["problems"]
    return [f"Error: {r['path']}: inspect found {len(problems)} problem(s):", *(f"  - {p}" for p in problems)]


def _plotted(v: dict) -> tuple[str, float, str]:
    """What the chart shows: the quantity the criterion judges (the error itself, or its ratio to
    round-to-nearest's for a calibrated method), its threshold and its axis label."""
    if v.get("max_error") is None:
        return "vs_rtn", v["max_ratio"], "relative error / round-to-nearest's on the same weights"
    return "rel_error", v["max_error"], "relative error ||w - x|| / ||x||"


def write_plot(report: dict, path: str) -> str:
    """A per-layer error chart of ``--verify``: PNG through matplotlib if installed, else a standalone SVG/HTML."""
    v = report.get("verify") or {}
    rows = [(m, e) for m, e in v.get("layers", {}).items() if "rel_error" in e]
    if not rows:
        raise ValueError("--plot needs --verify with at least one compared layer")
    key, limit, label = _plotted(v)
    bars = [(m, float(e[key])) for m, e in rows]
    if path.endswith(".png"):
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            path = path[: -len(".png")] + ".html"
        else:
            fig, ax = plt.subplots(figsize=(10, max(3, 0.18 * len(bars))))
            ax.barh([m for m, _ in bars][::-1], [e for _, e in bars][::-1])
            ax.axvline(limit, color="red", linestyle="--", label=f"threshold {limit}")
            ax.set_xlabel(label)
            ax.legend()
            fig.tight_layout()
            fig.savefig(path)
            plt.close(fig)
            return path
    with open(path, "w") as fh:
        fh.write(_html(report, v, bars, limit, label))
    return path


def _html(report: dict, v: dict, bars: list[tuple[str, float]], limit: float, label: str) -> str:
    """The chart as a standalone HTML page (an inline SVG)."""
    width, bar_h, label_w = 900, 14, 420
    scale = (width - label_w - 60) / max(max(e for _, e in bars), limit)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{(len(bars) + 2) * bar_h + 20}" '
           'font-family="monospace" font-size="11">']
    for i, (m, e) in enumerate(bars):
        y = 10 + i * bar_h
        color = "#c0392b" if e > limit else "#2e86c1"
        svg.append(f'<text x="0" y="{y + 10}">{escape(m)}</text><rect x="{label_w}" y="{y}" width="{e * scale:.1f}" '
                   f'height="{bar_h - 3}" fill="{color}"/><text x="{label_w + e * scale + 4:.1f}" y="{y + 10}">{e:.4f}</text>')
    x = label_w + limit * scale
    svg.append(f'<line x1="{x:.1f}" y1="5" x2="{x:.1f}" y2="{(len(bars) + 1) * bar_h}" stroke="red" stroke-dasharray="4"/>')
    svg.append("</svg>")
    o = v.get("overall") or {}
    return (f"<!doctype html><meta charset='utf-8'><title>fp4convert verify: {escape(report['path'])}</title>"
            f"<h3>{escape(report['path'])}: {report['scheme']} ({report['format']}) against {escape(v['source'])}</h3>"
            f"<p>{escape(label)}; mean rel.err {o.get('mean_rel_error', 0):.4f}, worst {o.get('worst_rel_error', 0):.4f} "
            f"({escape(str(o.get('worst_layer')))}), SNR {o.get('snr_db', 0):.1f} dB; criterion: "
            f"{escape(v.get('criterion', ''))}; threshold {limit} (dashed)</p>" + "".join(svg))
