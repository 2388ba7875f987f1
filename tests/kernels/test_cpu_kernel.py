"""The compiled CPU kernel (csrc/fp4c_cpu.cpp) against the reference, byte for byte, and its lazy build.

Every scheme x scale rule x input dtype x rotation x scale layout on random weights (several seeds and
shapes: odd M, one row, large K, matrices larger than one thread's job), golden edge cases (ties,
subnormals, -0, saturation, zero blocks and matrices, NaN/Inf per matrix, a rotation that overflows),
the exhaustive E2M1 check, the torch fallback, and the build: cache key, cache hit, lock, no compiler.
The kernel is built once into the normal cache (as a user's first call would); the build tests use
their own cache folders and fake compilers.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fp4convert
from fp4convert.kernels import cpu, cpu_lib as cpu_kernel, jit
from fp4convert.numerics import reference as ref
from fp4convert.errors import RotationOverflowError
from fp4convert.numerics.swizzle import swizzle_scales

from tests.oracle import fresh_seed, random_weight

RULES = [(s, r) for s in ("nvfp4", "mxfp4") for r in ref.SCALE_RULES[s]]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def lib():
    """The kernel, built (or found) in the normal cache; a skip only where no C++ compiler exists."""
    if jit.cxx() is None:
        pytest.skip("no C++ compiler: the kernel cannot be built here (the torch path is tested in test_cpu.py)")
    return cpu_kernel.load()  # raises (fails the tests) if a compiler is there but the build fails


def reference(x: torch.Tensor, scheme: str, rule: str, rotate: str | None, group_amax: torch.Tensor | None):
    """(packed, linear scale bytes, gs) of the reference, per matrix of a [B, M, K] batch."""
    if scheme == "nvfp4":
        packed, scale, gs = ref.nvfp4_quantize(x, group_amax, rotate, rule)
        return packed, scale.view(torch.uint8), gs.reshape(-1)
    packed, scale = ref.mxfp4_quantize(x, rotate, rule)
    return packed, scale, None


def kernel(lib, x, scheme, rule, rotate, swizzle, gs, threads=2):
    out = cpu_kernel.quantize(lib, x, scheme, gs, rotate, swizzle, rule, threads)
    assert out is not None
    packed, scale, flags = out
    return packed, scale.view(torch.uint8), flags


def check_matches_reference(lib, x, scheme, rule, rotate, group_amax=None, threads=(1, 2, 5)) -> None:
    """The kernel's bytes equal the reference's in both layouts and for each thread count."""
    rp, rs, rgs = reference(x, scheme, rule, rotate, group_amax)
    assert torch.equal(cpu_kernel.amax(lib, x, rotate, 2), ref.tensor_amax(x, rotate).reshape(-1))
    gs = None
    if scheme == "nvfp4":
        gs = ref.global_scale(cpu_kernel.amax(lib, x, rotate, 2) if group_amax is None else group_amax)
        assert torch.equal(gs, rgs)
    for n in threads:
        p, s, flags = kernel(lib, x, scheme, rule, rotate, False, gs, n)
        assert not flags.any()
        assert torch.equal(p, rp), f"packed differs ({scheme} {rule} {rotate} {x.dtype} {tuple(x.shape)} threads={n})"
        assert torch.equal(s, rs), f"scales differ ({scheme} {rule} {rotate} {x.dtype} {tuple(x.shape)} threads={n})"
    _, sw, _ = kernel(lib, x, scheme, rule, rotate, True, gs)
    assert torch.equal(sw, swizzle_scales(rs))


# ---------------------------------------------------------------------------------------------
# Random weights: every combination
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme,rule", RULES)
@pytest.mark.parametrize("rotate", [None, "had16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_combination_matches_reference(lib, scheme: str, rule: str, rotate: str | None, dtype) -> None:
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 37, 96), (1, 1, 32), (3, 5, 4096), (1, 130, 64)]  # odd M, one row, large K, a ragged tile
    for b, m, k in shapes:
        x = torch.stack([random_weight(m, k, seed + i) for i in range(b)])
        lo, hi = (-10, 4) if dtype == torch.float16 else (-20, 20)  # fp16 overflows above 65504
        x[-1] *= torch.exp2(torch.randint(lo, hi, (), generator=g).float())  # another binade per matrix
        check_matches_reference(lib, x.to(dtype), scheme, rule, rotate)


@pytest.mark.parametrize("scheme,rule", RULES)
def test_matrices_larger_than_a_job_and_group_amax(lib, scheme: str, rule: str) -> None:
    """Several jobs per matrix (2 x 67 x 2048: each job is 2^16 elements), threads sharing them, and a
    given group amax below the matrix's own (blocks saturate) or far above it."""
    seed = fresh_seed()
    x = torch.stack([random_weight(67, 2048, seed), random_weight(67, 2048, seed + 1) * 1e-3]).to(torch.bfloat16)
    check_matches_reference(lib, x, scheme, rule, None, threads=(1, 3, 16))
    if scheme == "nvfp4":
        own = ref.tensor_amax(x).reshape(-1)
        for ga in (own * 0.3, own * 1e6, torch.tensor([1e-38, 3.0])):
            check_matches_reference(lib, x, scheme, rule, "had16", group_amax=ga.to(torch.float32), threads=(2,))


def test_rule_weights_match_reference(lib) -> None:
    """test_cpu.py's rule weights: subnormal scales, tiny blocks and exact grid values."""
    from tests.kernels.test_cpu import rule_weight

    for scheme, rule in RULES:
        for rotate in (None, "had16"):
            check_matches_reference(lib, rule_weight(fresh_seed())[None], scheme, rule, rotate, threads=(2,))


# ---------------------------------------------------------------------------------------------
# Golden edge cases
# ---------------------------------------------------------------------------------------------

def golden_batch() -> torch.Tensor:
    """[4, 8, 64] fp32: every E2M1 tie at a scale of 1 (MXFP4 e = 127 for bmax in [4, 8)), subnormal
    and -0 blocks, an all-zero block, a block whose max saturates, and an all-zero matrix."""
    x = torch.zeros(4, 8, 64)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0])
    x[0, 0, :16] = ties
    x[0, 0, 16:32] = ties.flip(0) * 0.5  # the same ties half a step lower
    x[0, 1, :32] = torch.tensor([4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.75] * 4)  # saturation around 6..8
    x[0, 2] = torch.randn(64) * 1e-40  # fp32 subnormals
    x[0, 3, 5], x[0, 3, 40] = -0.0, 2.0**-149  # -0 and the smallest subnormal
    x[0, 4] = -0.0
    x[1] = torch.randn(8, 64) * 1e-38  # a matrix of tiny values: gs clamps near FLT_MAX
    x[2] = (torch.randn(8, 64) * 3e4).clamp(-6e4, 6e4)
    x[2, 0, 0] = 65504.0  # fp16's largest
    return x  # x[3]: all zero (amax 0, gs 1)


@pytest.mark.parametrize("scheme,rule", RULES)
@pytest.mark.parametrize("rotate", [None, "had16"])
def test_golden_edge_cases(lib, scheme: str, rule: str, rotate: str | None) -> None:
    x = golden_batch()
    for dtype in DTYPES:
        check_matches_reference(lib, x.to(dtype), scheme, rule, rotate, threads=(1, 2))
    # bf16 / fp16 subnormal inputs (exact widening)
    sub = torch.zeros(1, 2, 32)
    sub[0, 0] = torch.arange(1, 33) * 2.0**-133  # bf16 subnormals
    sub[0, 1] = torch.arange(-16, 16) * 2.0**-24  # fp16 subnormals
    check_matches_reference(lib, sub.to(torch.bfloat16), scheme, rule, rotate, threads=(1,))
    check_matches_reference(lib, sub.to(torch.float16), scheme, rule, rotate, threads=(1,))


def test_amax_zero_gives_gs_one_and_zero_bytes(lib) -> None:
    x = torch.zeros(2, 3, 32, dtype=torch.bfloat16)
    x[1, 2, 7] = -0.0
    amax = cpu_kernel.amax(lib, x, None, 2)
    assert amax.tolist() == [0.0, 0.0]
    gs = ref.global_scale(amax)
    p, s, flags = kernel(lib, x, "nvfp4", "4over6", None, False, gs)
    assert gs.tolist() == [1.0, 1.0] and not s.any() and not flags.any()
    assert int(p[1, 2, 3]) == 0x80  # -0 keeps its sign: code 8, in the high nibble (element 7)
    p[1, 2, 3] = 0
    assert not p.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotate", [None, "had16"])
def test_non_finite_flagged_per_matrix(lib, dtype, rotate: str | None) -> None:
    """NaN in matrix 1, Inf in matrix 3: their flags and amax say so; the other matrices are unaffected."""
    x = torch.randn(4, 16, 64).to(dtype)
    x[1, 7, 33] = float("nan")
    x[3, 0, 0] = float("-inf")
    amax = cpu_kernel.amax(lib, x, rotate, 2)
    want = ref.tensor_amax(x, rotate)
    assert torch.isnan(amax[1]) and not torch.isfinite(amax[3])
    assert torch.equal(amax[[0, 2]], want[[0, 2]])
    for scheme, rule in RULES:
        gs = ref.global_scale(amax) if scheme == "nvfp4" else None
        _, _, flags = kernel(lib, x, scheme, rule, rotate, False, gs)
        assert flags.tolist() == [False, True, False, True], (scheme, rule)
    # the tensor API refuses it, naming NaN/Inf
    with pytest.raises(fp4convert.NonFiniteError):
        fp4convert.quantize(x, rotate=rotate, backend="cpu")


def test_rotation_overflow_is_flagged(lib) -> None:
    """Finite values whose Had16 sum overflows fp32: flagged (the API says it is the rotation)."""
    x = torch.zeros(1, 2, 32)
    x[0, 1, :16] = 3e38
    _, _, flags = kernel(lib, x, "mxfp4", "floor", "had16", False, None)
    assert flags.tolist() == [True]
    assert not kernel(lib, x, "mxfp4", "floor", None, False, None)[2].any()
    with pytest.raises(RotationOverflowError):
        fp4convert.quantize(x[0], "mxfp4", rotate="had16", backend="cpu")


def test_empty_inputs(lib) -> None:
    for shape in ((0, 4, 32), (2, 0, 32), (2, 3, 0)):
        x = torch.zeros(shape, dtype=torch.bfloat16)
        assert torch.equal(cpu_kernel.amax(lib, x, None), torch.zeros(shape[0]))
        p, s, flags = kernel(lib, x, "nvfp4", "mse", None, False, torch.ones(shape[0]))
        assert p.shape == (*shape[:2], shape[2] // 2) and s.shape == (*shape[:2], shape[2] // 16) and not flags.any()


def test_e2m1_path_equals_the_predicate_sum_on_every_fp32_value(lib) -> None:
    """The kernel's E2M1 rounding (a float add that rounds, and the index from the value's bits)
    against reference.e2m1_encode's comparisons on all 2^32 bit patterns (NaNs aside: they are flagged)."""
    mismatches, first = cpu_kernel.e2m1_selftest(lib, os.cpu_count())
    assert mismatches == 0, f"first mismatch at fp32 bits {first:#010x}"


def x86_levels() -> list[str]:
    """The x86-64 micro-architecture levels this CPU runs (from /proc/cpuinfo); [] elsewhere."""
    import platform

    if platform.machine() != "x86_64" or not Path("/proc/cpuinfo").is_file():
        return []
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    levels = ["x86-64"]
    for name, need in (("x86-64-v2", {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}),
                       ("x86-64-v3", {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}),
                       ("x86-64-v4", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})):
        if not need <= flags:
            break
        levels.append(name)
    return levels


@pytest.mark.slow
def test_every_x86_level_gives_the_same_bytes(lib, tmp_path) -> None:
    """The library's clones are one source compiled per x86-64 level, and the loader picks one per CPU:
    each level this CPU runs, built alone (no clones), computes the same bytes as the reference."""
    levels = x86_levels()
    if not levels:
        pytest.skip("not an x86-64 Linux machine")
    base = cpu_kernel.spec()
    seed = fresh_seed()
    x = torch.cat([golden_batch(), torch.stack([random_weight(8, 64, seed + i) for i in range(2)])])
    built = []
    for level in levels:
        one = jit.BuildSpec(**{**base.__dict__, "flags": (*base.flags, "-DFP4C_NO_CLONES", f"-march={level}"),
                               "tag": f"cpu-{level}", "root": tmp_path})
        built.append((level, cpu_kernel.open_library(one.build())))
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for rotate in (None, "had16"):
            gs = ref.global_scale(ref.tensor_amax(xd, rotate).reshape(-1))
            for scheme, rule in RULES:
                rp, rs, _ = reference(xd, scheme, rule, rotate, None)
                for level, one_lib in built:
                    assert torch.equal(cpu_kernel.amax(one_lib, xd, rotate, 2), ref.tensor_amax(xd, rotate)), level
                    p, s, _ = kernel(one_lib, xd, scheme, rule, rotate, False, gs if scheme == "nvfp4" else None)
                    assert torch.equal(p, rp) and torch.equal(s, rs), (level, scheme, rule, rotate, dtype)


def test_threads_outlive_calls_and_a_forked_child_gets_its_own(lib) -> None:
    """The kernel keeps its worker threads between calls; a child forked after a threaded call (the
    CLI tests' zygote, torchrun's workers) has none of them and must start its own, not wait forever."""
    import signal
    import time

    x = torch.stack([random_weight(67, 2048, fresh_seed())]).to(torch.bfloat16)
    gs = ref.global_scale(ref.tensor_amax(x).reshape(-1))
    want = kernel(lib, x, "nvfp4", "4over6", None, False, gs, threads=4)
    again = kernel(lib, x, "nvfp4", "4over6", None, False, gs, threads=3)  # the pool, reused
    assert torch.equal(want[0], again[0]) and torch.equal(want[1], again[1])
    import ctypes

    def raw(t: torch.Tensor) -> bytes:  # no torch op in the child: torch's own OpenMP threads hang after fork
        return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())

    expected = raw(want[0]) + raw(want[1])
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when its threaded call gives the same bytes
        ok = False
        try:
            got = cpu_kernel.quantize(lib, x, "nvfp4", gs, None, False, "4over6", 4)
            ok = raw(got[0]) + raw(got[1]) == expected
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child's threaded kernel call hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


def test_bytes_do_not_depend_on_the_callers_flush_to_zero_mode(lib) -> None:
    """torch.set_flush_denormal(True) sets FTZ/DAZ in the calling thread; the kernel still computes IEEE."""
    x = golden_batch()[:1].to(torch.float32)
    x[0, 5] = torch.randn(64) * 1e-39  # subnormal inputs, which DAZ would read as zero
    want = kernel(lib, x, "mxfp4", "mse", None, False, None)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        got = kernel(lib, x, "mxfp4", "mse", None, False, None, threads=1)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    rp, rs = ref.mxfp4_quantize(x, None, "mse")
    assert torch.equal(got[0], rp) and torch.equal(got[1], rs)


# ---------------------------------------------------------------------------------------------
# The CPU path's choice between the kernel and torch
# ---------------------------------------------------------------------------------------------

def test_cpu_path_uses_the_kernel_and_the_switch_turns_it_off(lib, monkeypatch) -> None:
    calls = []
    real = cpu_kernel.quantize
    monkeypatch.setattr(cpu_kernel, "quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = random_weight(16, 64, fresh_seed())
    on = fp4convert.quantize(x, backend="cpu")
    assert calls
    monkeypatch.setenv("FP4CONVERT_CPU_KERNEL", "0")
    calls.clear()
    off = fp4convert.quantize(x, backend="cpu")
    assert not calls
    assert torch.equal(on.packed, off.packed) and torch.equal(on.scale.view(torch.uint8), off.scale.view(torch.uint8))


def test_a_rule_the_kernel_lacks_and_unsupported_dtypes_take_the_torch_path(lib, monkeypatch) -> None:
    x = random_weight(8, 64, fresh_seed())[None]
    gs = ref.global_scale(ref.tensor_amax(x[0]).reshape(1))
    monkeypatch.setattr(cpu_kernel, "_state", {"lib": lib})
    monkeypatch.setattr(lib, "fp4c_cpu_has_rule", lambda scheme, rule: 0)  # as for a rule added to torch only
    torch_path = []
    real = cpu._quantize_torch
    monkeypatch.setattr(cpu, "_quantize_torch", lambda *a: torch_path.append(1) or real(*a))
    p, s, _ = cpu.quantize(x, "nvfp4", gs, None, False, "mse")
    rp, rs, _ = ref.nvfp4_quantize(x[0], None, None, "mse")
    assert torch_path and torch.equal(p[0], rp) and torch.equal(s[0].view(torch.uint8), rs.view(torch.uint8))
    torch_path.clear()
    cpu.quantize(x.double(), "mxfp4", None, None, False, "floor")  # float64: the torch path's widening
    assert torch_path


def test_negative_global_scale_is_the_torch_paths_refusal(lib) -> None:
    x = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match="non-negative"):
        cpu.quantize(x, "nvfp4", torch.tensor([-1.0]), None, False, "max")


# ---------------------------------------------------------------------------------------------
# The lazy build
# ---------------------------------------------------------------------------------------------

def fake_compiler(tmp_path: Path, body: str) -> Path:
    """An executable standing in for g++: ``body`` runs with $OUT = the -o argument."""
    exe = tmp_path / "bin" / "fakecxx"
    exe.parent.mkdir(exist_ok=True)
    exe.write_text("#!/bin/sh\nOUT=\nprev=\nfor a in \"$@\"; do [ \"$prev\" = -o ] && OUT=$a; prev=$a; done\n" + body)
    exe.chmod(0o755)
    return exe


def spec_for(tmp_path: Path, compiler: Path, **kw) -> jit.BuildSpec:
    src = tmp_path / "lib.cpp"
    if not src.exists():
        src.write_text("int f(void) { return 1; }\n")
    return jit.BuildSpec(lib="libx.so", tag="cpu-test", compiler=(str(compiler),), sources=(src,),
                         flags=("-O1",), root=tmp_path / "cache", **kw)


def test_cache_path_covers_source_flags_compiler_and_target(tmp_path) -> None:
    cxx = fake_compiler(tmp_path, "exit 1\n")
    base = spec_for(tmp_path, cxx)
    key = base.key()
    assert spec_for(tmp_path, cxx).key() == key
    assert jit.BuildSpec(**{**base.__dict__, "flags": ("-O2",)}).key() != key
    other = jit.BuildSpec(**{**base.__dict__, "tag": "cpu-aarch64"})
    assert other.path().parent.name == f"cpu-aarch64-{key}" != base.path().parent.name  # the folder names the target
    assert jit.BuildSpec(**{**base.__dict__, "identity": ("torch 9",)}).key() != key
    src = base.sources[0]
    src.write_text(src.read_text() + "\n")
    edited = base.key()
    assert edited != key
    cxx.write_text(cxx.read_text() + "# another compiler version\n")  # size and mtime change
    assert base.key() != edited


def test_the_kernel_spec_is_keyed_by_this_machine_and_its_flags() -> None:
    if jit.cxx() is None:
        pytest.skip("no C++ compiler")
    s = cpu_kernel.spec()
    import platform

    assert s.tag == f"cpu-{platform.machine()}" and s.sources[0].name == cpu_kernel.SOURCE
    for flag in ("-fno-fast-math", "-ffp-contract=off", "-O3"):
        assert flag in s.flags
    assert not any(f.startswith("-march") or "fast-math" in f and f != "-fno-fast-math" for f in s.flags)


def test_build_then_cache_hit_runs_no_compiler(tmp_path, monkeypatch) -> None:
    log = tmp_path / "calls"
    cxx = fake_compiler(tmp_path, f"echo built >> {log}\necho lib > \"$OUT\"\n")
    spec = spec_for(tmp_path, cxx)
    path = spec.build()
    assert path.read_text() == "lib\n" and log.read_text() == "built\n"
    assert path.parent.name == f"cpu-test-{spec.key()}"
    assert not [p for p in path.parent.iterdir() if p.name not in (path.name, ".lock")]  # no temporary left

    def no_subprocess(*a, **k):
        raise AssertionError("the compiler ran on a cache hit")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert spec_for(tmp_path, cxx).build() == path


def test_concurrent_builds_compile_once(tmp_path) -> None:
    """Four processes ask for the same library at once: one compiles (slowly), the others wait on the
    lock and load its result."""
    log = tmp_path / "calls"
    cxx = fake_compiler(tmp_path, f"echo built >> {log}\nsleep 2\necho lib > \"$OUT\"\n")
    spec_for(tmp_path, cxx)  # writes the source
    code = textwrap.dedent(f"""
        import importlib, sys, types
        from pathlib import Path
        # jit.py and errors.py alone (stdlib only, as a bare package): the four processes start within
        # milliseconds of each other, without the package's imports
        pkg = types.ModuleType("fp4c_pkg")
        pkg.__path__ = [str(Path({jit.__file__!r}).parent)]
        sys.modules["fp4c_pkg"] = pkg
        jit = importlib.import_module("fp4c_pkg.jit")
        s = jit.BuildSpec(lib="libx.so", tag="cpu-test", compiler=({str(cxx)!r},), sources=(Path({str(tmp_path / 'lib.cpp')!r}),),
                          flags=("-O1",), root=Path({str(tmp_path / 'cache')!r}))
        print(s.build().read_text().strip())
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outs == ["lib"] * 4 and [p.returncode for p in procs] == [0] * 4
    assert log.read_text() == "built\n"


def test_failed_build_leaves_nothing_and_says_why(tmp_path) -> None:
    cxx = fake_compiler(tmp_path, "echo 'fp4c_cpu.cpp:1: error: broken' >&2\necho partial > \"$OUT\"\nexit 1\n")
    with pytest.raises(jit.BuildFailed, match="broken"):
        spec_for(tmp_path, cxx).build()
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_no_compiler_warns_once_and_the_torch_path_gives_the_same_bytes(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setenv("FP4CONVERT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    x = random_weight(8, 64, fresh_seed())
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("fp4convert.kernels.cpu")
    logger.addHandler(handler)
    try:
        a = fp4convert.quantize(x, backend="cpu")
        b = fp4convert.quantize(x, "mxfp4", rotate="had16", backend="cpu")
    finally:
        logger.removeHandler(handler)
    warnings = [r for r in records if "compiled CPU kernel is unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no-such-compiler" in warnings[0].getMessage()
    assert cpu_kernel.get() is None and not list(tmp_path.rglob("*.so"))
    ra = fp4convert.quantize(x, backend="reference")
    assert torch.equal(a.packed, ra.packed) and torch.equal(a.scale.view(torch.uint8), ra.scale.view(torch.uint8))
    rb = fp4convert.quantize(x, "mxfp4", rotate="had16", backend="reference")
    assert torch.equal(b.packed, rb.packed) and torch.equal(b.scale, rb.scale)


def test_prepare_builds_in_the_background_and_get_waits_for_it(tmp_path, monkeypatch) -> None:
    """prepare() starts the one build; get() called meanwhile returns the library that build made."""
    import threading

    monkeypatch.setattr(cpu_kernel, "_state", {})
    started, release = threading.Event(), threading.Event()
    sentinel = object()
    calls = []

    def slow_load():
        calls.append(1)
        started.set()
        release.wait(10)
        return sentinel

    monkeypatch.setattr(cpu_kernel, "load", slow_load)
    cpu_kernel.prepare()
    assert started.wait(10)
    cpu_kernel.prepare()  # a second call while the first builds: no second build
    threading.Timer(0.2, release.set).start()
    assert cpu_kernel.get() is sentinel and cpu_kernel.get() is sentinel
    assert calls == [1]


def test_no_compiler_on_path(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert jit.cxx() is None
    with pytest.raises(jit.BuildFailed, match="no C\\+\\+ compiler"):
        cpu_kernel.spec()


def test_import_builds_nothing(tmp_path) -> None:
    code = "import fp4convert, fp4convert.kernels.cpu, fp4convert.kernels.cpu_lib; print('ok')"
    env = {**os.environ, "FP4CONVERT_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "ok" and not any(tmp_path.iterdir())
