"""What planning costs: time and peak memory of ``plan.make_plan`` on a 70B and a 671B checkpoint.

Planning reads headers only, so it is measured on the tensor lists of the released checkpoints
(names and shapes of Llama-3-70B and DeepSeek-V3 written out here, no data), with and without the
model definition (fp4convert/plan/definition.py builds the model from config.json on the ``meta`` device,
in a child process, and caches it on disk; "without" makes ``modeldef.load`` raise ``Unknown``, so the
name rules plan). Each measurement runs in a fresh process with a fresh definition cache; ``make_plan``
is timed twice: the first call (cold cache: what a first run pays, the child's imports of torch and
transformers included) and a second one (the definition read from the cache). Peak RSS is the planning
process's (with its growth over its imports) and the definition builder's. Median of 3 runs.

    python benchmarks/plan_cost.py            # table, and benchmarks/results/plan_cost.json
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's fp4convert

LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "vocab_size": 129280, "num_nextn_predict_layers": 1, "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 0, "eos_token_id": 1,
}


def llama_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    return out


def deepseek_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The released DeepSeek-V3 names (bf16 shapes; the release is FP8, which only adds scales)."""
    h, v, nh = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    out = [("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    for n in range(c["num_hidden_layers"] + c["num_nextn_predict_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_a_proj.weight", (c["q_lora_rank"], h)),
                (p + "self_attn.q_a_layernorm.weight", (c["q_lora_rank"],)),
                (p + "self_attn.q_b_proj.weight", (nh * qk, c["q_lora_rank"])),
                (p + "self_attn.kv_a_proj_with_mqa.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], h)),
                (p + "self_attn.kv_a_layernorm.weight", (c["kv_lora_rank"],)),
                (p + "self_attn.kv_b_proj.weight", (nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])),
                (p + "self_attn.o_proj.weight", (h, nh * c["v_head_dim"]))]
        if n < c["first_k_dense_replace"]:
            i = c["intermediate_size"]
            out += [(p + f"mlp.{m}.weight", s) for m, s in (("gate_proj", (i, h)), ("up_proj", (i, h)),
                                                           ("down_proj", (h, i)))]
        else:
            i = c["moe_intermediate_size"]
            out += [(p + "mlp.gate.weight", (c["n_routed_experts"], h)),
                    (p + "mlp.gate.e_score_correction_bias", (c["n_routed_experts"],))]
            for e in [*range(c["n_routed_experts"])]:
                q = f"{p}mlp.experts.{e}."
                out += [(q + "gate_proj.weight", (i, h)), (q + "up_proj.weight", (i, h)), (q + "down_proj.weight", (h, i))]
            si = i * c["n_shared_experts"]
            out += [(p + "mlp.shared_experts.gate_proj.weight", (si, h)), (p + "mlp.shared_experts.up_proj.weight", (si, h)),
                    (p + "mlp.shared_experts.down_proj.weight", (h, si))]
        if n >= c["num_hidden_layers"]:  # the MTP layer's own modules
            out += [(p + "enorm.weight", (h,)), (p + "hnorm.weight", (h,)), (p + "eh_proj.weight", (h, 2 * h)),
                    (p + "shared_head.norm.weight", (h,)), (p + "shared_head.head.weight", (v, h)),
                    (p + "embed_tokens.weight", (v, h))]
    return out


MODELS = {"llama3-70b": (LLAMA3_70B, llama_tensors), "deepseek-v3-671b": (DEEPSEEK_V3, deepseek_tensors)}
SHARD = 5 * 2**30  # tensors laid out in ~5 GB shards, as released


def infos(tensors: list[tuple[str, tuple[int, ...]]]):
    from fp4convert.storage.safetensors import TensorInfo

    out, file, off = [], 1, 0
    for name, shape in tensors:
        n = 2
        for d in shape:
            n *= d
        if off + n > SHARD:
            file, off = file + 1, 0
        out.append(TensorInfo(name, "BF16", tuple(shape), f"model-{file:05d}.safetensors", off + 8, off + 8 + n))
        off += n
    return out


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def one(model: str, definition: bool) -> dict:
    """One measurement, in this process (run by ``main`` in a fresh one)."""
    import tempfile

    from fp4convert.plan import definition as modeldef
    from fp4convert.config import ConvertConfig
    from fp4convert.formats import get_format
    from fp4convert.plan.planner import make_plan

    cfg, make = MODELS[model]
    tensors = infos(make(cfg))
    if not definition:
        def refuse(*_a, **_k):
            raise modeldef.Unknown("measured without the model definition")
        modeldef.load = refuse
    os.environ["FP4CONVERT_DEFINITION_CACHE"] = tempfile.mkdtemp(prefix="fp4c_defcache_")  # a cold cache
    config = ConvertConfig(device="cpu", format="compressed-tensors")
    fmt = get_format(config.format)
    base = _rss_mb()
    t0 = time.perf_counter()
    plan = make_plan(tensors, config, fmt, dict(cfg))
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the definition's builder
    t0 = time.perf_counter()
    make_plan(tensors, config, fmt, dict(cfg))  # again: the definition now comes from the cache
    warm = time.perf_counter() - t0
    quantized = sum(d.action == "quantize" for d in plan.decisions)
    return {"model": model, "definition": definition, "knowledge": plan.knowledge.describe() if plan.knowledge else {},
            "tensors": len(tensors), "quantized": quantized, "seconds": dt, "warm_seconds": warm, "rss_before_mb": base,
            "peak_rss_mb": peak, "peak_over_imports_mb": peak - base, "child_peak_rss_mb": child}


def main() -> int:
    runs = 3
    rows = []
    for model in MODELS:
        for definition in (False, True):
            got = []
            for _ in range(runs):
                out = subprocess.run([sys.executable, __file__, "--one", model, str(int(definition))],
                                     capture_output=True, text=True, check=True)
                got.append(json.loads(out.stdout.strip().splitlines()[-1]))
            med = {k: statistics.median(g[k] for g in got) for k in ("seconds", "warm_seconds", "peak_rss_mb", "peak_over_imports_mb",
                                                                       "rss_before_mb", "child_peak_rss_mb")}
            rows.append({**got[0], **med, "runs": [g["seconds"] for g in got]})
    print(f"{'model':18} {'definition':10} {'tensors':>8} {'quantized':>9} {'plan s':>7} {'again s':>7} "
          f"{'peak RSS MB':>11} {'over imports':>12} {'child peak MB':>13}")
    for r in rows:
        print(f"{r['model']:18} {str(r['definition']):10} {r['tensors']:>8} {r['quantized']:>9} {r['seconds']:>7.2f} "
              f"{r['warm_seconds']:>7.2f} {r['peak_rss_mb']:>11.0f} {r['peak_over_imports_mb']:>12.0f} {r['child_peak_rss_mb']:>13.0f}")
    print("plan s: make_plan with a cold definition cache (what a first run pays: the definition is built in a "
          "child process that imports transformers); again s: the same plan with the definition cached on disk; "
          "peak RSS: the planning process; child peak: the definition builder's process")
    import transformers

    res = {"cpus": os.cpu_count(), "load_average_after": os.getloadavg(), "machine": platform.processor() or platform.machine(),
           "python": platform.python_version(), "transformers": transformers.__version__, "median_of": runs,
           "rows": rows}
    path = ROOT / "benchmarks/results/plan_cost.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2], sys.argv[3] == "1")))
        sys.exit(0)
    sys.exit(main())
