"""One token step of self-generation replayed as a CUDA graph.

Self-generated samples are written one token per step, every sample at once: 255 steps for the
default 256-token samples. On a GPU each eager step of a transformers model is a few milliseconds of
Python and kernel launches for far less GPU work (one pass over resident weights), so the steps are
host-bound. Here the model runs on a :class:`transformers.StaticCache` (fixed shapes, the position a
device tensor), one step is captured as a CUDA graph, and every later step is one replay.

The graph is an optimisation, never a different result: before it is used, its replays of two steps
must give the logits of the same steps run eagerly, bit for bit (:class:`GraphedSteps`), or the steps
run eagerly. Models whose forward cannot run on a static cache (their own
cache classes, host synchronisation inside the forward) keep the eager dynamic-cache loop; which path
a model takes is decided by the model and the device alone, so a seed still gives the same samples run
to run on one device.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class GraphedSteps:
    """Token steps of ``model`` on ``samples`` rows, positions 0, 1, 2, ... in order: :meth:`step`
    returns the next-token logits (fp32, ``[samples, vocab]``) of position ``pos`` given the tokens at it.

    Positions 0-2 run eagerly on a static cache of their own (``check``) while the same steps build the
    graph's cache: position 0 eagerly, 1 and 2 as replays of the step captured at 1. When both replays'
    logits equal the eager ones bit for bit, the later steps are replays; otherwise (or when the capture
    fails) they run eagerly on ``check``, whose history is the same.
    """

    def __init__(self, model, samples: int, seq_len: int, device: torch.device, vocab: int, key: str,
                 capture: bool = True) -> None:
        import inspect

        import torch
        from transformers import StaticCache

        self.model, self.vocab, self.key = model, vocab, key
        # the position as device tensors (no host value the graph would freeze): position_ids always, and
        # cache_position where the forward still takes it (transformers before the cache rename)
        self.takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        self.check = StaticCache(config=model.config, max_cache_len=seq_len)
        self.cache: object | None = StaticCache(config=model.config, max_cache_len=seq_len) if capture else None
        self.ids = torch.zeros((samples, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((1,), dtype=torch.long, device=device)
        self.position_ids = self.pos.view(1, 1)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    @property
    def graphed(self) -> bool:
        """Whether the steps are replays now (after position 2, once the check passed)."""
        return self.graph is not None and self.check is None

    def _forward(self, cache):
        kw = {self.key: cache, "position_ids": self.position_ids}
        if self.takes_cache_position:
            kw["cache_position"] = self.pos
        out = self.model(input_ids=self.ids, use_cache=True, **kw)
        return out.logits[:, -1, :self.vocab]

    def step(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        import torch

        self.ids.copy_(ids)
        self.pos.fill_(pos)
        if self.check is None:  # (checked: replays)
            assert self.graph is not None and self.out is not None
            self.graph.replay()
            return self.out.float()
        want = self._forward(self.check).float()
        if self.cache is None:
            return want  # (the graph was dropped: eager on the check cache)
        if pos == 0:
            self._forward(self.cache)
            return want
        if pos == 1 and not self._capture():
            self.cache = None
            return want
        assert self.graph is not None and self.out is not None
        self.graph.replay()
        if not torch.equal(self.out.float(), want):
            log.debug("self-generation steps run eagerly: the captured step's logits differ from the eager step's")
            self.graph = self.out = self.cache = None
            return want
        if pos == 2:
            self.check = None  # (checked)
        return want

    def _capture(self) -> bool:
        import torch

        dev = self.ids.device
        graph = torch.cuda.CUDAGraph()
        try:
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                out = self._forward(self.cache)
            torch.cuda.current_stream(dev).wait_stream(stream)
        except Exception as exc:  # noqa: BLE001 (any failure to capture: the eager steps stay)
            log.debug("self-generation steps run eagerly: the step cannot be captured as a CUDA graph (%s)", exc)
            return False
        self.graph, self.out = graph, out
        return True


def graphed_steps(model, samples: int, seq_len: int, device, vocab: int, key: str,
                  capture: bool = True) -> GraphedSteps | None:
    """A :class:`GraphedSteps` for ``model`` on a CUDA ``device`` (``key``: the forward's cache
    argument), or None where the static cache does not apply (a CPU, a forward without
    ``position_ids``, a config transformers' StaticCache cannot size). ``capture`` False (weights
    loaded by hooks at every step: nothing to capture): the same steps, all eager on the static cache,
    so both give the same samples."""
    import inspect

    import torch

    if torch.device(device).type != "cuda" or seq_len < 3:
        return None
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return None
    try:
        return GraphedSteps(model, samples, seq_len, torch.device(device), vocab, key, capture)
    except Exception as exc:  # noqa: BLE001 (a model the static cache does not know: the eager loop)
        log.debug("self-generation steps run eagerly: no static cache for this model (%s)", exc)
        return None
