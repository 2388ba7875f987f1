"""The input statistics (fp4convert/calibrate/stats.py): the Hessian sum, taken when it is first read."""

from __future__ import annotations

import torch

from fp4convert.calibrate import stats
from fp4convert.calibrate.stats import Observer, Observers


def batches(seed: int, k: int = 48) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, k, generator=g) * 3 for n in (5, 7, 3)]


def eager(xs: list[torch.Tensor]) -> torch.Tensor:
    """Each batch's X^T X (fp64) summed in arrival order: what the Hessian was before it waited."""
    h = None
    for x in xs:
        f = x.reshape(-1, x.shape[-1])
        g = f.double().T @ f.double()
        h = g if h is None else h.add_(g)
    assert h is not None
    return h


def test_the_hessian_taken_when_read_is_the_sum_in_arrival_order_bit_for_bit():
    xs = batches(1)
    o = Observer(hessian=True)
    for x in xs:
        o.add(x)
    assert len(o.pending) == 3 and o.count == 30
    assert torch.equal(o.xtx, eager(xs))
    assert o.pending == [] and torch.equal(o.hessian_matrix(), eager(xs) / 30)
    o.add(xs[0])  # (a batch after a read is added to the sum, as before)
    assert torch.equal(o.xtx, eager([*xs, xs[0]]))


def test_a_hessian_nobody_reads_costs_no_matmul(monkeypatch):
    """GPTQ's true-sequential pass drops the first run's Hessians of the later steps' inputs unread."""
    calls = []
    gram = stats._gram
    monkeypatch.setattr(stats, "_gram", lambda a, b: calls.append(1) or gram(a, b))
    obs = Observers(hessian=True)
    for x in batches(2):
        obs.add("blk.o_proj", x)
    obs.drop(["blk.o_proj"])
    kept = Observer(hessian=True)
    kept.add(batches(3)[0])
    kept.release()
    assert calls == []
    obs.add("blk.o_proj", batches(4)[0])
    assert obs["blk.o_proj"].hessian_matrix() is not None and calls == [1]


def test_waiting_batches_are_their_own_copies_and_bounded(monkeypatch):
    xs = batches(5)
    o = Observer(hessian=True)
    x = xs[0].clone()
    o.add(x)
    x.mul_(0.0)  # (the model reusing the input's memory)
    assert torch.equal(o.xtx, eager(xs[:1]))
    monkeypatch.setattr(stats, "DEFER_BYTES", 2 * 7 * 48 * 4)  # (one batch of 14 rows fits, two do not)
    o = Observer(hessian=True)
    for x in xs:
        o.add(x)
        assert sum(t.numel() * t.element_size() for _, t in o.pending) <= stats.DEFER_BYTES
    assert torch.equal(o.xtx, eager(xs))


def test_waiting_batches_keep_their_chunks():
    """Under torchrun a rank sums its chunks apart (Observer.parts): a batch waiting for its X^T X goes into its
    own chunk's sum, and the chunks' total is the same bits as when each batch was summed on arrival."""
    xs = batches(6)
    o = Observer(hessian=True)
    for chunk, x in zip((0, 0, 1), xs):
        o.add(x, chunk)
    o.flush()
    assert torch.equal(o.parts["xtx"][0], eager(xs[:2])) and torch.equal(o.parts["xtx"][1], eager(xs[2:]))
    assert torch.equal(o.xtx, eager(xs[:2]) + eager(xs[2:]))
