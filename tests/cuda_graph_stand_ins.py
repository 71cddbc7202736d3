"""CPU stand-ins for CUDA graph capture (runtime/engine/cuda_graphs.py's injectable primitive), for tests that put one in
``cuda_graphs.CAPTURE_PRIMITIVES["cpu"]``."""

from __future__ import annotations

import torch


class RecordedGraph:
    """A replay: the recorded step again, its result written into the output tensor captured the first time (what
    a CUDA graph replay does to its static output)."""

    def __init__(self, fn, out: torch.Tensor):
        self.fn, self.out, self.replays = fn, out, 0

    def __call__(self) -> None:
        self.replays += 1
        self.out.copy_(self.fn())


class RecordingCapture:
    """Captures by recording the callable; replays by calling it again on the persistent buffers."""

    def capture(self, fn):
        out = fn()
        return RecordedGraph(fn, out), out


class StaleCapture:
    """A broken capture: replays leave the output as it was at capture time (the padding rows' hidden states)."""

    def capture(self, fn):
        out = fn()
        return (lambda: None), out


class RaisingCapture:
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")
