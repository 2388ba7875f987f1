"""What an output is, in words: weight-only or W4A4, and what data (if any) its scales were measured on.

The model card, ``inspect`` (text and JSON) and the run's summary line all say this; they read it here,
from the manifest's records (``activations``: the W4A4 section; ``identity.input_weights``: the
input-weighted scale rules' measurement), so they cannot disagree. Torch-free (the CLI imports it).
"""

from __future__ import annotations


def activations_of(manifest: dict | None) -> dict | None:
    """The W4A4 record of a manifest, as reports show it: ``{"scheme", "scales", "calibration"}`` where
    ``scales`` is "calibrated", "constant" or "dynamic" ("stored": inspect found scales but no manifest);
    None for a weight-only output."""
    rec = (manifest or {}).get("activations")
    if not isinstance(rec, dict) or not isinstance(rec.get("scheme"), str):
        return None
    cal = rec.get("calibration") if isinstance(rec.get("calibration"), dict) else None
    out: dict = {"scheme": rec["scheme"], "scales": "dynamic", "calibration": None}
    if cal is not None:
        method = cal.get("method")
        out["scales"] = "constant" if method == "constant" else "stored" if method == "stored" else "calibrated"
        keep = ("method", "samples", "seq_len", "seed", "data", "amax", "tokenizer_sha256")
        out["calibration"] = {k: cal[k] for k in keep if k in cal and not (k == "amax" and isinstance(cal[k], dict))}
    return out


def _data(d: object) -> str:
    if not isinstance(d, dict):
        return "?"
    return str(d.get("name") or d.get("source") or "?")


def describe_activations(a: dict | None) -> str:
    """One phrase: "weights only (activations stay in the model's dtype)" or what W4A4 does with activations."""
    if a is None:
        return "weights only (activations stay in the model's dtype)"
    scheme = str(a.get("scheme", "?")).upper()
    cal = a.get("calibration") or {}
    if a.get("scales") == "dynamic":
        return f"W4A4: activations quantized to {scheme} at run time (dynamic scales, nothing calibrated)"
    if a.get("scales") == "constant":
        return (f"W4A4: activations quantized to {scheme} with a constant static scale (amax {cal.get('amax', 2688.0)}, "
                "no calibration; larger activations clip)")
    if a.get("scales") == "stored":  # read from the tensors alone (no manifest records how they were had)
        return f"W4A4: activations quantized to {scheme} with a stored static scale per linear (how it was had is not recorded)"
    return (f"W4A4: activations quantized to {scheme} with a static scale per linear, calibrated on "
            f"{cal.get('samples', '?')} x {cal.get('seq_len', '?')} tokens ({_data(cal.get('data'))})")


def describe_method(manifest: dict | None) -> str:
    """How the weights were rounded and their scales chosen, as far as data goes: round-to-nearest (data-free,
    or its scales weighted by measured input weights), or a calibrated method (the manifest's ``method``
    record: its own description and the calibration data it ran on)."""
    g = (manifest or {}).get("method")
    if isinstance(g, dict) and isinstance(g.get("description"), str) and "calibration" not in g:
        return g["description"]  # a record of no calibration pass (a re-layout of another tool's checkpoint)
    if isinstance(g, dict) and isinstance(g.get("description"), str):
        cal: dict = g["calibration"] if isinstance(g.get("calibration"), dict) else {}
        return (f"{g['description']}, on {cal.get('samples', '?')} x {cal.get('seq_len', '?')} calibration tokens "
                f"({_data(cal.get('data'))})")
    if isinstance(g, dict) and isinstance(g.get("method"), str):
        return f"calibrated method {g['method']}"
    rec = ((manifest or {}).get("identity") or {}).get("input_weights")
    if not isinstance(rec, dict):
        return "round-to-nearest, data-free (no calibration set)"
    tokens = f"{rec.get('samples', '?')} x {rec.get('seq_len', '?')} tokens"
    if rec.get("source") == "random":
        return ("round-to-nearest, scales weighted by per-channel input mean squares measured on seeded random "
                f"token ids ({tokens})")
    return ("round-to-nearest, scales weighted by per-channel input mean squares measured on calibration data "
            f"({_data(rec.get('data'))}, {tokens})")


def run_note(activations: str | None, activation_scale: str | None) -> str:
    """The run's summary line's note (", W4A4 ..."), from the options (the run has no manifest loaded)."""
    if not activations or activations == "none":
        return ""
    if activations == "mxfp4":
        return ", W4A4 with dynamic activation scales"
    return ", W4A4 with constant activation scales, no calibration" if activation_scale == "constant" else \
        ", W4A4 with calibrated activation scales"


def loading_hint(fmt: str, scheme: str, dst: str) -> str:
    """How to load what a run wrote, in one line (the run's summary): the native layout is read by no
    engine or library until ``fp4convert export`` re-lays it out (into the formats that hold ``scheme``);
    the others name who reads them (the format's facts; the card's "Serving" section has the commands)."""
    from fp4convert.formats import all_formats, get_format
    from fp4convert.storage.names import CARD_NAME

    f = get_format(fmt)
    card = f"{dst}/{CARD_NAME}"
    if f.described_by_manifest:
        targets = [o.name for o in all_formats() if not o.described_by_manifest and scheme in o.schemes]
        more = "".join(f" (or --format {t})" for t in targets[1:])
        return (f"load: nothing loads the {fmt} layout as is; re-lay it out first (lossless, no source needed): "
                f"fp4convert export {dst} OUT --format {targets[0]}{more}; {card} (Serving) says what reads each")
    if f.transformers_loads:
        return f"load: transformers' from_pretrained or an engine, as {card} shows (Serving)"
    return f"load: an engine, as {card} shows (Serving); transformers does not read this format"
