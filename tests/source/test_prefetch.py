"""Hub shards fetched ahead of the conversion (fp4convert/source/prefetch.py), against the stand-in Hub.

In process, through huggingface_hub's real download path (``hf_hub_download``) against
``tests/hubserver.py`` with a throttled link; ``Source.local_path`` is wrapped to log when the run
first asks for each shard (and to make the "conversion" of a shard take a while), and the server logs
when each download begins and ends, on the one monotonic clock. The unit tests at the end drive
:class:`~fp4convert.source.prefetch.Prefetcher` with a stand-in fetch.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import pytest

from fp4convert.source import prefetch as pf
from fp4convert.config import ConvertConfig
from fp4convert.run.convert import convert, plan_conversion
from fp4convert.errors import SourceError
from fp4convert.source.release import ShardReleaser
from fp4convert.source.hub import HubSource as Source  # the Hub source (these tests are about it)

from tests import checkpoints as ck

REPO = "tiny-org/six-shards"
COMMIT = hashlib.sha1(b"fp4convert prefetch test").hexdigest()
N = 6
SHARDS = [f"model-{i:05d}-of-{N:05d}.safetensors" for i in range(1, N + 1)]
CFG = ConvertConfig(device="cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prefetch_model")
    cfg = ck.llama_config(hidden=128, layers=N)
    t = ck.llama_tensors(cfg, seed=4)
    shards = [[n for n in t if n.startswith(f"model.layers.{i}.")] for i in range(N)]  # ~300 KB each
    shards[0].append("model.embed_tokens.weight")
    shards[-1] += ["model.norm.weight", "lm_head.weight"]
    ck.write(root, t, cfg, shards)
    return root


@pytest.fixture(scope="module")
def local_out(model, tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("prefetch_local") / "out"
    convert(str(model), out, CFG)
    return ck.all_files(out)


def online(monkeypatch, tmp_path: Path, model: Path, **options):
    """A started FakeHub serving ``model`` as REPO that huggingface_hub (imported) talks to."""
    from huggingface_hub import constants

    from tests.hubserver import FakeHub

    hub = FakeHub(lifetime=120, **options)
    hub.add(REPO, model, COMMIT)
    hub.start()
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    return hub


class Asks:
    """Source.local_path wrapped: when each shard was first asked for; ``hold`` s of 'conversion' after."""

    def __init__(self, monkeypatch, hold: float = 0.0) -> None:
        self.first: dict[str, float] = {}
        self.lock = threading.Lock()
        original = Source.local_path

        def local_path(source: Source, file: str) -> Path:
            with self.lock:
                new = file not in self.first
                if new:
                    self.first[file] = time.monotonic()
            path = original(source, file)
            if new and hold:
                time.sleep(hold)
            return path

        monkeypatch.setattr(Source, "local_path", local_path)


def downloads(hub) -> list:
    """The full downloads, in the order they began (two are in flight at once)."""
    return sorted((r for r in hub.requests(server="cdn", method="GET") if r.range is None), key=lambda r: r.started)


def shard_outputs(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if k.endswith((".safetensors", ".index.json"))}


def no_prefetch_thread() -> bool:
    """No download or checker thread of a prefetcher is left."""
    return not [t for t in threading.enumerate() if t.name.startswith("fp4convert-prefetch")]


def blobs(cache: Path) -> set[str]:
    d = cache / ("models--" + REPO.replace("/", "--")) / "blobs"
    return {p.name for p in d.iterdir()} if d.exists() else set()


def test_shards_are_fetched_ahead_and_no_further(model, local_out, tmp_path, monkeypatch) -> None:
    """Each shard is downloaded once, in order, before the run asks for it, but never more than AHEAD
    shards beyond the one the run has reached; the output is the local folder's, byte for byte."""
    hub = online(monkeypatch, tmp_path, model, rate=8e6)  # ~0.05 s a shard; "converting" one takes 0.8 s
    asks = Asks(monkeypatch, hold=0.8)
    try:
        convert(REPO, tmp_path / "out", CFG)
    finally:
        hub.stop()
    got = downloads(hub)
    assert sorted(r.file for r in got) == SHARDS and all(r.status == 200 for r in got)  # each once
    assert shard_outputs(ck.all_files(tmp_path / "out")) == shard_outputs(local_out)
    start = {r.file: r.started for r in got}
    ask = [asks.first[s] for s in SHARDS]
    for k in range(1, N):
        assert start[SHARDS[k]] < ask[k], f"{SHARDS[k]} was not fetched ahead"
    for k in range(pf.AHEAD + 1, N):
        # The bound: shard k waits until the run reached shard k - AHEAD ...
        assert start[SHARDS[k]] > ask[k - pf.AHEAD], f"{SHARDS[k]} fetched more than {pf.AHEAD} ahead"
        # ... and no longer (the download then starts while shard k - AHEAD converts).
        assert start[SHARDS[k]] < ask[k - pf.AHEAD + 1], f"{SHARDS[k]} not fetched {pf.AHEAD} ahead"
    assert no_prefetch_thread()
    assert hub.errors == []


def test_delete_source_shards_holds_at_most_ahead_more(model, local_out, tmp_path, monkeypatch) -> None:
    """--delete-source-shards: whenever a download begins, the cache holds only shards the run has
    reached and not let go of, plus fewer than AHEAD beyond it; each shard leaves the cache after the
    run last asked for it, all of them by the end; the output is unchanged."""
    cache = tmp_path / "cache"
    seen: list[tuple[str, float, set[str]]] = []
    hub = online(monkeypatch, tmp_path, model, rate=8e6,
                 on_full_get=lambda f: seen.append((f, time.monotonic(), blobs(cache))))
    asks = Asks(monkeypatch, hold=0.4)
    released: dict[str, float] = {}
    original = ShardReleaser.release

    def release(self, file: str) -> None:
        original(self, file)
        released[file] = time.monotonic()  # gone from the cache by now

    monkeypatch.setattr(ShardReleaser, "release", release)
    try:
        source, plan, fmt = plan_conversion(REPO, CFG)
        convert(source, tmp_path / "out", CFG, delete_source_shards=True, plan=(source, plan, fmt))
    finally:
        hub.stop()
    assert shard_outputs(ck.all_files(tmp_path / "out")) == shard_outputs(local_out)
    sha = {hashlib.sha256((model / s).read_bytes()).hexdigest(): s for s in SHARDS}
    assert not blobs(cache) & set(sha) and sorted(released) == SHARDS
    assert sorted(f for f, _, _ in seen) == SHARDS  # each once (two connections: either may reach the server first)
    for file, t, present in seen:
        reached = max((SHARDS.index(f) for f, at in asks.first.items() if at <= t), default=0)
        held = [sha[b] for b in present if b in sha]
        for f in held:  # reached and not released yet, or fetched ahead (within the window)
            i = SHARDS.index(f)
            assert i <= reached + pf.AHEAD and (i > reached or released.get(f, t + 1) > t), (file, held)
        assert len([f for f in held if SHARDS.index(f) > reached]) < pf.AHEAD, (file, held, reached)
    for f in SHARDS:
        assert released[f] > asks.first[f]


def test_delete_source_shards_keeps_a_shard_a_later_unit_reads(tmp_path, monkeypatch) -> None:
    """An FP8 weight whose block scale sits in an earlier shard (a split a DeepSeek-style index can
    have): --delete-source-shards keeps that shard until the unit that reads the scale is done (it was
    deleted after its own layer: exit 4 blaming the source); the output equals the local conversion's."""
    from tests.zoo import fp8_block_quantize

    cfg = ck.llama_config(hidden=128, layers=4)
    t = ck.llama_tensors(cfg, seed=3)
    for n in list(t):
        if n.endswith("proj.weight") and "layers." in n:
            t[n], t[n + "_scale_inv"] = fp8_block_quantize(t[n], (128, 128))
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3",
                                  "activation_scheme": "dynamic"}
    far = "model.layers.3.mlp.down_proj.weight_scale_inv"
    first = [n for n in t if n.startswith("model.layers.0.")] + ["model.embed_tokens.weight", far]
    rest = [n for n in t if n not in first]
    shards = [[n for n in rest if n.startswith(f"model.layers.{i}.")] for i in range(1, 4)]
    shards[-1] += [n for n in rest if not n.startswith("model.layers.")]
    model = tmp_path / "fp8"
    ck.write(model, t, cfg, [first, *shards])
    convert(str(model), tmp_path / "local", CFG)
    files = sorted(p.name for p in model.glob("*.safetensors"))
    hub = online(monkeypatch, tmp_path, model)
    released: list[str] = []
    original = ShardReleaser.release

    def release(self, file: str) -> None:
        original(self, file)
        released.append(file)

    monkeypatch.setattr(ShardReleaser, "release", release)
    try:
        source, plan, fmt = plan_conversion(REPO, CFG)
        convert(source, tmp_path / "out", CFG, delete_source_shards=True, plan=(source, plan, fmt))
    finally:
        hub.stop()
    assert shard_outputs(ck.all_files(tmp_path / "out")) == shard_outputs(ck.all_files(tmp_path / "local"))
    # the first shard goes after layers 1 and 2's shards: with layer 3's unit, which reads the scale
    assert sorted(released) == files and released.index(files[0]) > released.index(files[2])


def test_a_plan_refused_after_planning_stops_the_downloads(model, tmp_path, monkeypatch) -> None:
    """`--only` matching nothing is refused (exit 2) after the plan, while the early prefetch is
    downloading: the downloads stop with it (no thread, no partial file left in the HF cache)."""
    from click.testing import CliRunner
    from huggingface_hub import constants

    from fp4convert.cli.main import main

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)  # cancellation is looked for once per chunk
    hub = online(monkeypatch, tmp_path, model, rate=0.1e6)
    try:
        r = CliRunner().invoke(main, ["quantize", REPO, str(tmp_path / "out"), "--only", "nomatch*", "--device", "cpu"])
        assert r.exit_code == 2 and "quantizes no tensor" in r.output, r.output
        assert no_prefetch_thread()
    finally:
        hub.stop()
    assert not list((tmp_path / "cache").rglob("*.incomplete")) and not (tmp_path / "out").exists()


def test_stopping_does_not_wait_for_a_stalled_download(model, tmp_path, monkeypatch) -> None:
    """A download whose server sends nothing more cannot see the cancellation (it looks once per chunk
    received): stopping returns after JOIN_S, not after huggingface_hub's timeouts and retries (a minute
    and more), and the stalled file's partial download is removed from the cache."""
    from fp4convert.source.open import open_source

    stalled, release = threading.Event(), threading.Event()

    def stall(file: str) -> None:
        if file == SHARDS[1]:
            stalled.set()
            release.wait(120)

    hub = online(monkeypatch, tmp_path, model, on_full_get=stall)
    source = open_source(REPO)
    try:
        source.tensors()
        source.prefetch_early()
        assert stalled.wait(30)
        time.sleep(0.5)
        t0 = time.monotonic()
        source.stop_prefetch()
        assert time.monotonic() - t0 < 10  # JOIN_S (5 s) and the cleanup
    finally:
        release.set()
        hub.stop()
    assert not list((tmp_path / "cache").rglob("*.incomplete"))


def test_a_server_that_ignores_range_is_said_so(model, tmp_path, monkeypatch) -> None:
    """A server that answers a range request with the whole file: the headers come from downloaded
    shards instead, and the run says so once (a --dry-run downloading every shard was silent)."""
    from click.testing import CliRunner

    from fp4convert.cli.main import main

    hub = online(monkeypatch, tmp_path, model, honor_range=False)
    try:
        r = CliRunner().invoke(main, ["quantize", REPO, str(tmp_path / "d"), "--dry-run", "--device", "cpu"])
    finally:
        hub.stop()
    assert r.exit_code == 0, r.output
    said = [line for line in r.output.splitlines() if "did not answer a range request" in line]
    assert len(said) == 1 and SHARDS[0] in said[0] and f"and {N - 1} more" in said[0], r.output


def test_a_failed_download_is_raised_where_the_shard_is_needed(model, tmp_path, monkeypatch) -> None:
    """The third shard fails on the CDN: the run stops with the one-line error naming it (exit 4), after
    converting what came before; nothing after it is fetched; no partial download or thread is left."""
    hub = online(monkeypatch, tmp_path, model, rate=8e6, fail_full_get={SHARDS[2]: 500})
    asks = Asks(monkeypatch, hold=0.2)
    try:
        with pytest.raises(SourceError) as e:
            convert(REPO, tmp_path / "out", CFG)
    finally:
        hub.stop()
    msg = str(e.value)
    assert SHARDS[2] in msg and "500" in msg and "\n" not in msg and msg.startswith(REPO)
    assert e.value.exit_code == 4
    files = sorted(r.file for r in downloads(hub))
    # the other connection may have begun the shard after the failed one; nothing later starts
    assert files[:3] == SHARDS[:3] and set(files[3:]) <= {SHARDS[3]}, files
    assert set(asks.first) >= set(SHARDS[:3]) and not set(asks.first) & set(SHARDS[3:])
    assert not list((tmp_path / "cache").rglob("*.incomplete"))
    assert no_prefetch_thread()


def test_an_interrupted_run_cancels_the_download_in_flight(model, tmp_path, monkeypatch) -> None:
    """Ctrl-C while a shard downloads ahead (slowly): the download stops part-way, huggingface_hub's
    temporary file is gone, no thread is left; the shards already complete stay in the cache."""
    from huggingface_hub import constants

    from fp4convert.run import work

    # huggingface_hub looks for cancellation once per chunk it reads (10 MB); these shards are 300 KB
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)
    hub = online(monkeypatch, tmp_path, model, rate=0.15e6)  # 2 s a shard
    original = work.quantize
    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 2:  # shard 1 converting; shard 2 on the way
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(work, "quantize", interrupted)
    size = {s: (model / s).stat().st_size for s in SHARDS}
    try:
        with pytest.raises(KeyboardInterrupt):
            convert(REPO, tmp_path / "out", CFG)
        assert no_prefetch_thread()
        # the server saw the client hang up
        wait_for(lambda: any(r.sent < size[r.file] for r in downloads(hub)))
    finally:
        hub.stop()
    got = downloads(hub)
    full = [r.file for r in got if r.sent == size[r.file]]
    part = [r.file for r in got if r.sent < size[r.file]]
    assert SHARDS[0] in full and part, [(r.file, r.sent) for r in got]  # one in flight stopped part-way
    # begun in order, each once, never beyond the window of the second shard (the run reached at most it)
    assert sorted(full + part) == SHARDS[: len(got)] and len(got) <= 2 + pf.AHEAD
    assert not list((tmp_path / "cache").rglob("*.incomplete"))
    sha = {s: hashlib.sha256((model / s).read_bytes()).hexdigest() for s in SHARDS}
    # the shard the run read stays; a shard the server sent whole may still have been cancelled before the
    # client read its last chunk (the socket buffers it), so the cache holds a subset of `full`, never a part
    assert sha[SHARDS[0]] in blobs(tmp_path / "cache")
    shards_kept = blobs(tmp_path / "cache") & set(sha.values())
    assert shards_kept <= {sha[f] for f in full}


# --- fetching while the plan is made ----------------------------------------------------------------

def slow_plan(monkeypatch, seconds: float, fail: Exception | None = None) -> dict[str, float]:
    """make_plan (the model definition's seconds) takes ``seconds``; returns when it began and ended."""
    import fp4convert.plan.planner as plan_mod

    real, when = plan_mod.make_plan, {}

    def make_plan(*a, **k):
        when["begin"] = time.monotonic()
        time.sleep(seconds)
        when["end"] = time.monotonic()
        if fail is not None:
            raise fail
        return real(*a, **k)

    monkeypatch.setattr(plan_mod, "make_plan", make_plan)
    return when


def test_the_first_shards_download_while_the_plan_is_made(model, local_out, tmp_path, monkeypatch) -> None:
    """A conversion of a Hub source starts downloading in index order while it plans (the link idled
    there: 11 s of a 42 s run on the H100 host), at most AHEAD beyond the first shard; the run then goes
    on with the same prefetcher: every shard downloaded once, in order, the output unchanged."""
    hub = online(monkeypatch, tmp_path, model, rate=8e6)
    when = slow_plan(monkeypatch, 1.5)
    try:
        convert(REPO, tmp_path / "out", CFG)
    finally:
        hub.stop()
    got = downloads(hub)
    assert sorted(r.file for r in got) == SHARDS  # each once
    during = sorted(r.file for r in got if r.started < when["end"])
    assert during == SHARDS[: pf.AHEAD + 1], during  # the first and AHEAD more, no further
    assert shard_outputs(ck.all_files(tmp_path / "out")) == shard_outputs(local_out)
    assert no_prefetch_thread() and hub.errors == []


def test_the_first_shard_downloads_while_the_headers_are_read(model, local_out, tmp_path, monkeypatch) -> None:
    """The early start does not wait for the header reads: each range read of another shard's header
    waits here until the first shard's download has begun (it had not, before: the link idled for
    every header's three round trips); the output is unchanged."""
    import fp4convert.source.hub as source_mod

    hub = online(monkeypatch, tmp_path, model, rate=8e6)
    first_download = threading.Event()
    original_download, original_header = source_mod.HubSource._download, source_mod._remote_header
    seen: dict[str, bool] = {}

    def download(source: Source, file: str, cancelled=None) -> Path:
        if file == SHARDS[0]:
            first_download.set()
        return original_download(source, file, cancelled)

    def remote_header(repo_id, file, revision, token=None):
        if file != SHARDS[0]:
            seen[file] = first_download.wait(5)
        return original_header(repo_id, file, revision, token)

    monkeypatch.setattr(Source, "_download", download)
    monkeypatch.setattr(source_mod, "_remote_header", remote_header)
    try:
        convert(REPO, tmp_path / "out", CFG)
    finally:
        hub.stop()
    assert seen == dict.fromkeys(SHARDS[1:], True)
    assert sorted(r.file for r in downloads(hub)) == SHARDS  # each once
    assert shard_outputs(ck.all_files(tmp_path / "out")) == shard_outputs(local_out)
    assert no_prefetch_thread() and hub.errors == []


def test_headers_are_read_several_at_a_time(model, tmp_path, monkeypatch) -> None:
    """The range reads of the headers overlap (up to HEADER_CONNECTIONS); the plan is the one a
    sequential read gives, and a malformed header is reported for the first such file in order."""
    import fp4convert.source.hub as source_mod
    from fp4convert.errors import CheckpointFormatError
    from fp4convert.source.open import open_source

    hub = online(monkeypatch, tmp_path, model)
    original = source_mod._remote_header
    lock, active, most = threading.Lock(), [0], [0]

    def remote_header(repo_id, file, revision, token=None):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            time.sleep(0.2)
            if file in (SHARDS[2], SHARDS[4]) and bad:
                raise CheckpointFormatError(f"{file}: bad header")
            return original(repo_id, file, revision, token)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(source_mod, "_remote_header", remote_header)
    try:
        bad = False
        source = open_source(REPO)
        parallel = source.tensors()
        assert most[0] == min(N, source_mod.HEADER_CONNECTIONS) > 1
        monkeypatch.setattr(source_mod, "HEADER_CONNECTIONS", 1)
        assert open_source(REPO).tensors() == parallel
        bad = True
        monkeypatch.setattr(source_mod, "HEADER_CONNECTIONS", 8)
        with pytest.raises(CheckpointFormatError, match=SHARDS[2]):
            open_source(REPO).tensors()
    finally:
        hub.stop()
    assert downloads(hub) == []  # headers only


def test_a_download_checked_before_its_header_is_read_is_still_compared(model, tmp_path, monkeypatch) -> None:
    """With the early start a shard can finish downloading before its header's range read does: its
    check waits for the read, so a range answer that differs from the downloaded file is still exit 4."""
    import fp4convert.source.hub as source_mod
    from fp4convert.errors import CheckpointFormatError

    hub = online(monkeypatch, tmp_path, model)
    downloaded = threading.Event()
    original_download, original_header = source_mod.HubSource._download, source_mod._remote_header

    def download(source: Source, file: str, cancelled=None) -> Path:
        path = original_download(source, file, cancelled)
        if file == SHARDS[0]:
            downloaded.set()
        return path

    def remote_header(repo_id, file, revision, token=None):
        got = original_header(repo_id, file, revision, token)
        if file != SHARDS[0]:
            return got
        assert downloaded.wait(10)
        time.sleep(0.3)  # the checker has the file by now
        infos, meta = got
        return infos[::-1], meta  # what a lying range answer would have planned

    monkeypatch.setattr(Source, "_download", download)
    monkeypatch.setattr(source_mod, "_remote_header", remote_header)
    try:
        with pytest.raises(CheckpointFormatError, match="header differs from the one read by range"):
            convert(REPO, tmp_path / "out", CFG)
    finally:
        hub.stop()
    assert no_prefetch_thread()


def test_a_dry_run_or_a_refused_plan_downloads_nothing_more(model, tmp_path, monkeypatch) -> None:
    """--dry-run fetches no shard; a plan that fails stops what the early start began (no thread, no
    partial download left)."""
    from click.testing import CliRunner
    from huggingface_hub import constants

    from fp4convert.cli.main import main
    from fp4convert.errors import PlanError

    # slow enough that the first shard is still in flight when the plan fails; huggingface_hub looks for
    # cancellation once per chunk it reads (10 MB); these shards are 300 KB
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)
    hub = online(monkeypatch, tmp_path, model, rate=0.1e6)
    try:
        r = CliRunner().invoke(main, ["quantize", REPO, str(tmp_path / "d"), "--dry-run", "--device", "cpu"])
        assert r.exit_code == 0, r.output
        assert downloads(hub) == [] and no_prefetch_thread()
        slow_plan(monkeypatch, 0.5, fail=PlanError("refused"))
        with pytest.raises(PlanError, match="refused"):
            convert(REPO, tmp_path / "out", CFG)
        assert no_prefetch_thread()
        wait_for(lambda: len(downloads(hub)) >= 1)  # the server saw the client hang up
        time.sleep(1.5)  # the other connection's too (the server notices at its next paced write)
    finally:
        hub.stop()
    got = downloads(hub)
    files = sorted(r.file for r in got)
    assert files == SHARDS[: len(files)] and len(files) <= pf.CONNECTIONS, files  # begun during the plan
    assert all(r.sent < (model / r.file).stat().st_size for r in got)  # and cancelled part-way
    assert not list((tmp_path / "cache").rglob("*.incomplete"))


def test_another_order_replaces_the_early_prefetch(model, tmp_path, monkeypatch) -> None:
    """When the run reads the shards in another order than the index's, the early prefetcher is stopped
    and one in the run's order takes over."""
    from huggingface_hub import constants

    from fp4convert.source.open import open_source

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)  # cancellation is looked for once per chunk
    hub = online(monkeypatch, tmp_path, model, rate=0.1e6)
    try:
        source = open_source(REPO)
        source.prefetch_early()
        early = source._prefetcher
        assert early is not None and early.order == SHARDS
        _, plan, _ = plan_conversion(source, CFG)
        units = plan.units()
        source.prefetch(units)
        assert source._prefetcher is early  # the same order: kept
        source.prefetch(list(reversed(units)))
        assert source._prefetcher is not early and source._prefetcher.order == list(reversed(SHARDS))
        assert early._ended
    finally:
        source.stop_prefetch()
        hub.stop()
    assert no_prefetch_thread()


# --- the Prefetcher alone -------------------------------------------------------------------------

class Fetches:
    """A stand-in fetch: logs starts, waits for ``gate`` (or cancellation), fails where told."""

    def __init__(self, fail: str | None = None) -> None:
        self.started: list[str] = []
        self.gate = threading.Event()
        self.fail = fail
        self.cancelled = False

    def __call__(self, file: str, cancelled) -> Path:
        self.started.append(file)
        while not self.gate.wait(0.01):
            if cancelled():
                self.cancelled = True
                raise pf.Cancelled(file)
        if file == self.fail:
            raise SourceError(f"org/m: cannot fetch {file} (HTTPError: 500)")
        return Path("/cache") / file


def wait_for(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_window_is_ahead_files_beyond_the_position() -> None:
    fetch = Fetches()
    fetch.gate.set()
    p = pf.Prefetcher(list("abcdef"), fetch, ahead=2, connections=1)
    try:
        wait_for(lambda: len(fetch.started) == 3)
        time.sleep(0.2)
        assert fetch.started == list("abc")  # position 0: a, then two ahead
        assert p.get("b") == Path("/cache/b")  # the run reaches b: d may come
        wait_for(lambda: len(fetch.started) == 4)
        time.sleep(0.2)
        assert fetch.started == list("abcd")
        assert p.get("f") == Path("/cache/f")  # a jump: everything up to f, in order
        assert fetch.started == list("abcdef")
        assert p.get("zz") is None  # not its file: the caller fetches it
    finally:
        p.stop()


def test_no_room_means_no_fetch_ahead() -> None:
    """room() refuses: only what the run has reached is fetched; it allows: the window fills."""
    fetch = Fetches()
    fetch.gate.set()
    allowed = threading.Event()
    p = pf.Prefetcher(list("abcd"), fetch, ahead=2, room=lambda f, pos: allowed.is_set(), connections=1)
    try:
        assert p.get("a") == Path("/cache/a")
        time.sleep(0.3)
        assert fetch.started == ["a"]
        assert p.get("b") == Path("/cache/b")  # needed now: fetched regardless
        time.sleep(0.3)
        assert fetch.started == ["a", "b"]
        allowed.set()
        wait_for(lambda: len(fetch.started) == 4)  # polled: no notification needed
    finally:
        p.stop()


def test_failure_raised_for_that_file_and_later_ones_only() -> None:
    fetch = Fetches(fail="b")
    fetch.gate.set()
    p = pf.Prefetcher(list("abcd"), fetch, ahead=3, connections=1)
    try:
        assert p.get("a") == Path("/cache/a")
        for f in "bcd":
            with pytest.raises(SourceError, match="cannot fetch b"):
                p.get(f)
        assert fetch.started == ["a", "b"]  # nothing after the failure
    finally:
        p.stop()


def test_stop_cancels_the_fetch_in_flight_and_wakes_waiters() -> None:
    fetch = Fetches()
    p = pf.Prefetcher(list("ab"), fetch, ahead=1, connections=1)
    wait_for(lambda: fetch.started == ["a"])
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            p.get("a")
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    p.stop()
    t.join(5)
    assert not t.is_alive() and isinstance(errors[0], pf.Cancelled)
    assert fetch.cancelled and fetch.started == ["a"]
    assert no_prefetch_thread()


def test_a_check_runs_beside_the_next_download() -> None:
    """With ``check``, a file is handed out only once checked, and its connection starts the next
    download meanwhile (one connection here: hashed on it, nothing else would start); a failed check
    is raised for that file and the later ones."""
    fetch = Fetches()
    fetch.gate.set()
    release = threading.Event()
    checked: list[str] = []

    def check(file: str, path: Path, cancelled) -> None:
        if file == "a":
            while not release.wait(0.01):
                if cancelled():
                    raise pf.Cancelled(file)
        if file == "c":
            raise SourceError("org/m: c does not match the Hub's sha256")
        checked.append(file)

    p = pf.Prefetcher(list("abcde"), fetch, ahead=2, connections=1, check=check)
    try:
        wait_for(lambda: fetch.started == list("abc"))  # a's check is pending, the window still fills
        waiter = threading.Thread(target=p.get, args=("a",), daemon=True)
        waiter.start()
        time.sleep(0.2)
        assert waiter.is_alive() and checked == []  # a is not handed out unchecked
        release.set()
        waiter.join(5)
        assert not waiter.is_alive() and checked[0] == "a"
        assert p.get("b") == Path("/cache/b")
        for f in "cde":
            with pytest.raises(SourceError, match="c does not match"):
                p.get(f)
    finally:
        p.stop()
    assert no_prefetch_thread()


def test_two_connections_start_in_order_within_the_window() -> None:
    """Two fetches in flight at once (one connection does not fill a link), claimed in order, never
    beyond the window; a failure stops new starts and cancels a later file in flight, not an earlier one."""
    fetch = Fetches()
    p = pf.Prefetcher(list("abcdef"), fetch, ahead=2)
    try:
        wait_for(lambda: len(fetch.started) == 2)
        time.sleep(0.2)
        assert sorted(fetch.started) == ["a", "b"]  # both connections busy, c waits for one
        fetch.gate.set()
        wait_for(lambda: len(fetch.started) == 3)
        time.sleep(0.2)
        assert sorted(fetch.started) == ["a", "b", "c"]  # the window: position 0 and 2 ahead
        assert p.get("d") == Path("/cache/d")
        assert p.get("f") == Path("/cache/f")
        assert sorted(fetch.started) == list("abcdef")
    finally:
        p.stop()
    assert no_prefetch_thread()

    class Slow(Fetches):
        def __call__(self, file: str, cancelled) -> Path:
            self.started.append(file)
            if file == "b":  # fails once c is in flight on the other connection
                wait_for(lambda: "c" in self.started)
                raise SourceError("org/m: cannot fetch b (HTTPError: 500)")
            if file == "c":
                while not cancelled():
                    time.sleep(0.01)
                self.cancelled = True
                raise pf.Cancelled(file)
            return Path("/cache") / file

    fetch = Slow()
    p = pf.Prefetcher(list("abcde"), fetch, ahead=3)
    try:
        assert p.get("a") == Path("/cache/a")
        with pytest.raises(SourceError, match="cannot fetch b"):
            p.get("d")
        wait_for(lambda: fetch.cancelled)
        time.sleep(0.2)
        assert "d" not in fetch.started and "e" not in fetch.started  # nothing starts after the failure
    finally:
        p.stop()
    assert no_prefetch_thread()
