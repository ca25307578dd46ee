"""CUDA-graph capture and replay of a decode step, so its small launches cost one graph launch.

A decode step of the MoE (five Triton launches plus a few torch ops) is launch-bound at batch 1; replaying
a captured graph removes the per-launch CPU cost and the gaps between kernels. Graphs need static
addresses, so each signature (a key plus the inputs' shapes and dtypes) gets its own static input copies.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CapturedStep:
    """One captured graph with the static tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor


class StepGraphs:
    """Runs `fn(*inputs)` through CUDA graphs, one per (key, input shapes/dtypes).

    The first call of a signature runs eagerly (it compiles and warms the kernels), the second captures a
    graph on static copies of the inputs; every later call copies the inputs in and replays. The returned
    tensor is the graph's static output, overwritten by the next replay of the same signature, so it must be
    consumed before then (a decode step consumes it at once). Graphs share one memory pool and must run one
    at a time on one stream, as a model's layers do. `max_graphs` bounds how many signatures are captured.
    """

    def __init__(self, max_graphs: int = 1024) -> None:
        self.max_graphs = max_graphs
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[Hashable, CapturedStep] = {}
        self._seen: set[Hashable] = set()

    def __call__(self, key: Hashable, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        sig = (key, *((tuple(t.shape), t.dtype, t.device) for t in inputs))
        step = self._graphs.get(sig)
        if step is None:
            if sig not in self._seen or len(self._graphs) >= self.max_graphs:
                self._seen.add(sig)
                return fn(*inputs)
            step = self._graphs[sig] = self.capture(fn, *inputs)
        for static, value in zip(step.inputs, inputs, strict=True):
            static.copy_(value)
        step.graph.replay()
        return step.output

    @property
    def captured(self) -> int:
        """Number of graphs held."""
        return len(self._graphs)

    def capture(self, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> CapturedStep:
        """Capture fn on static copies of `inputs` (fn's kernels must have run once already, outside capture)."""
        static = tuple(t.detach().clone() for t in inputs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = fn(*static)
        return CapturedStep(graph, static, output)
