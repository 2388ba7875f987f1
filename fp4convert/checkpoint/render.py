"""An inspect report as a person reads it: the text report, the errors-only lines of ``-q``, and the per-layer
error chart of ``--verify --plot``."""

from __future__ import annotations

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
        if r.get("method"):
            lines.append(f"  weights: {describe_method({'method': r['method']})}")
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
        lines.append(f"  verify against {v['source']} (source fingerprint: {v['fingerprint']}):")
        for m, e in v["layers"].items():
            if "error" in e:
                lines.append(f"    {m}: {e['error']}")
            else:
                flag = "  > max-error" if e["rel_error"] > v["max_error"] else ""
                lines.append(f"    {m:<44} rel.err {e['rel_error']:.4f}  SNR {e['snr_db']:.1f} dB{flag}")
        o = v["overall"]
        if o:
            lines.append(f"    overall: mean rel.err {o['mean_rel_error']:.4f}, worst {o['worst_rel_error']:.4f} "
                         f"({o['worst_layer']}), SNR {o['snr_db']:.1f} dB over {o['layers']} layers; "
                         f"threshold {v['max_error']}")
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


def render_errors(r: dict) -> list[str]:
    """What ``inspect --quiet`` prints (errors only): nothing for a sound checkpoint, else one ``Error:``
    line with the verdict and the problems below it."""
    if r["verdict"] == OK:
        return []
    if r["verdict"] == NOT_QUANTIZED:
        return [f"Error: {r['path']}: not quantized (no FP4 weights; inspect expects an FP4 checkpoint)"]
    problems = r["checks"]["problems"]
    return [f"Error: {r['path']}: inspect found {len(problems)} problem(s):", *(f"  - {p}" for p in problems)]


def write_plot(report: dict, path: str) -> str:
    """A per-layer error chart of ``--verify``: PNG through matplotlib if installed, else a standalone SVG/HTML."""
    v = report.get("verify") or {}
    rows = [(m, e["rel_error"]) for m, e in v.get("layers", {}).items() if "rel_error" in e]
    if not rows:
        raise ValueError("--plot needs --verify with at least one compared layer")
    if path.endswith(".png"):
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            path = path[: -len(".png")] + ".html"
        else:
            fig, ax = plt.subplots(figsize=(10, max(3, 0.18 * len(rows))))
            ax.barh([m for m, _ in rows][::-1], [e for _, e in rows][::-1])
            ax.axvline(v["max_error"], color="red", linestyle="--", label=f"max-error {v['max_error']}")
            ax.set_xlabel("relative error ||w - x|| / ||x||")
            ax.legend()
            fig.tight_layout()
            fig.savefig(path)
            plt.close(fig)
            return path
    width, bar_h, label_w = 900, 14, 420
    scale = (width - label_w - 60) / max(max(e for _, e in rows), v["max_error"])
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{(len(rows) + 2) * bar_h + 20}" '
           'font-family="monospace" font-size="11">']
    for i, (m, e) in enumerate(rows):
        y = 10 + i * bar_h
        color = "#c0392b" if e > v["max_error"] else "#2e86c1"
        svg.append(f'<text x="0" y="{y + 10}">{m}</text><rect x="{label_w}" y="{y}" width="{e * scale:.1f}" '
                   f'height="{bar_h - 3}" fill="{color}"/><text x="{label_w + e * scale + 4:.1f}" y="{y + 10}">{e:.4f}</text>')
    x = label_w + v["max_error"] * scale
    svg.append(f'<line x1="{x:.1f}" y1="5" x2="{x:.1f}" y2="{(len(rows) + 1) * bar_h}" stroke="red" stroke-dasharray="4"/>')
    svg.append("</svg>")
    o = v.get("overall") or {}
    html = (f"<!doctype html><meta charset='utf-8'><title>fp4convert verify: {report['path']}</title>"
            f"<h3>{report['path']}: {report['scheme']} ({report['format']}) against {v['source']}</h3>"
            f"<p>mean rel.err {o.get('mean_rel_error', 0):.4f}, worst {o.get('worst_rel_error', 0):.4f} "
            f"({o.get('worst_layer')}), SNR {o.get('snr_db', 0):.1f} dB; threshold {v['max_error']} (dashed)</p>"
            + "".join(svg))
    with open(path, "w") as fh:
        fh.write(html)
    return path
