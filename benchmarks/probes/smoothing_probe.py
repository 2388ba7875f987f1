"""Does smoothing pay for NVFP4 W4A4? A probe before any code: the served model simulated in PyTorch.

The norm-fed inputs (q/k/v's, gate/up's) divided per channel by SmoothQuant's s_j = amax_x^a / amax_w^(1-a)
(amax over benchmarks/accuracy_gptq.py's 32 x 256 calibration tokens; q/k/v and gate/up each share one s),
the weights' columns multiplied by it and rounded to nearest (NVFP4, rule 4over6, a global scale per
matrix), the inputs rounded as the engine rounds them (NVFP4, static global scale from the smoothed
input's amax); scored as benchmarks/accuracy.py scores (mean next-token KL against the unquantized model on
its 2048 held-out tokens). Alpha 0 is the same simulation without smoothing. The real thing is
``--smooth`` (fp4convert/calibrate/smooth.py), measured by benchmarks/accuracy_gptq.py.

    python benchmarks/probes/smoothing_probe.py smollm2-135m 0,0.3,0.5 [out.json]
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: accuracy, accuracy_gptq, accuracy_w4a4
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import accuracy as acc  # noqa: E402
import accuracy_gptq as ag  # noqa: E402
import accuracy_w4a4 as w4  # noqa: E402
import torch  # noqa: E402

from fp4convert.numerics import reference as ref  # noqa: E402

name = sys.argv[1]
alphas = [float(a) for a in sys.argv[2].split(",")]
fed = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
torch.set_num_threads(2)
bench = acc.load_bench(name, n_tokens=2048, seq_len=512, batch=4)
work = Path(acc.DEFAULT_CACHE) / name / "gptq"
_, _, tokens = ag.calibration(bench.checkpoint, work, 32, 256)
mods = dict(bench.model.named_modules())
names = [w[:-len(".weight")] for w in bench.linears]
chan = {}


def seen(_m, a, _n):
    x = a[0].detach().abs().reshape(-1, a[0].shape[-1]).amax(0).float()
    chan[_n] = torch.maximum(chan.get(_n, torch.zeros_like(x)), x)


hooks = [mods[n].register_forward_pre_hook(lambda m, a, _n=n: seen(m, a, _n)) for n in names]
with torch.inference_mode():
    for x in tokens.split(4):
        bench.model(x)
for h in hooks:
    h.remove()
groups = {}
for n in names:
    if n.endswith(fed):
        key = n.rsplit(".", 2)[0] + (":attn" if n.rsplit(".", 1)[1][0] in "qkv" else ":mlp")
        groups.setdefault(key, []).append(n)
params = dict(bench.model.named_parameters())
res = {}
for alpha in alphas:
    s = {n: torch.ones(chan[n].shape) for n in names}
    if alpha > 0:
        for key, ns in groups.items():
            ax = chan[ns[0]].clamp(min=1e-5)
            aw = torch.stack([params[n + ".weight"].detach().abs().amax(0) for n in ns]).amax(0).clamp(min=1e-5)
            v = ax ** alpha / aw ** (1 - alpha)
            v = v / torch.exp(torch.log(v).mean())
            for n in ns:
                s[n] = v
    weights, gs = {}, {}
    for n in names:
        w = params[n + ".weight"].detach() * s[n]
        p, sc, g = ref.nvfp4_quantize(w, None, None, "4over6")
        weights[n + ".weight"] = ref.nvfp4_dequantize(p, sc, g, None).float()
        gs[n] = torch.tensor(448.0 * 6.0 / float((chan[n] / s[n]).max()))
    def hook(n, x):
        return w4.nvfp4_act(x / s[n].to(x.dtype), gs[n]).to(x.dtype)
    t = time.time()
    r = acc.evaluate(bench, weights, hook)
    res[alpha] = r
    print(name, "alpha", alpha, r, round(time.time() - t, 1), flush=True)
if len(sys.argv) > 3:
    with open(sys.argv[3], "w") as f:
        json.dump({"model": name, "alphas": res}, f, indent=1)
