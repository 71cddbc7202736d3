"""Where an engine step's time goes (issue 14): host time per phase, and the device time of the forward pass.

Off by default: ``ModelRunner.step_timer`` is None and each phase boundary in the step costs one ``is not None``
test. A profiler (benchmarks/gpu_check_profile.py) sets a :class:`StepTimer` there; the engine and the runner
then call :meth:`StepTimer.mark` at every boundary, so the phases tile the step with no gap: time belongs to
the phase last marked. On CUDA two events bracket the forward pass (or graph replay) and are read at the end
of the step, after the sampled tokens' copy to the host has synchronised anyway, so timing adds no sync to a
sampling step.

A phase's host time includes whatever it waits for: a blocking host-to-device copy waits for the GPU work
queued before it, and the copy of the sampled tokens to the host waits for the forward pass and the sampler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

SCHEDULE = "schedule"
PREPARE = "build inputs and block tables"
H2D = "host-to-device copies"  # the step's input tensors from host lists, and the device ops deriving decode metadata
FORWARD = "forward call / graph replay"
LOGITS = "LM head (logits)"
SAMPLE = "sampling"
D2H = "device-to-host sync of sampled tokens"
POSTPROCESS = "postprocess (scheduler, drafts)"
DETOKENIZE = "detokenize / stream outputs"
PHASES = (SCHEDULE, PREPARE, H2D, FORWARD, LOGITS, SAMPLE, D2H, POSTPROCESS, DETOKENIZE)


@dataclass
class StepRecord:
    wall_ns: int
    phase_ns: dict[str, int]
    gpu_ms: float | None  # the forward pass between its two CUDA events; None off CUDA or without a forward
    rows: int  # sequences in the step
    decode: bool  # every entry computed one token (no prefill chunk, no drafts)
    replayed: bool  # the forward was a CUDA graph replay


class StepTimer:
    def __init__(self, device: str | torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.records: list[StepRecord] = []
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if self.cuda else None
        self._forward_timed = False
        self.replayed = False
        self._phase, self._start, self._last = SCHEDULE, 0, 0
        self._acc: dict[str, int] = {}

    def begin(self) -> None:
        self._start = self._last = time.perf_counter_ns()
        self._phase, self._acc = SCHEDULE, dict.fromkeys(PHASES, 0)
        self._forward_timed = self.replayed = False

    def mark(self, phase: str) -> None:
        """From now on the step's time belongs to ``phase``."""
        now = time.perf_counter_ns()
        self._acc[self._phase] += now - self._last
        self._phase, self._last = phase, now

    def forward_started(self) -> None:
        if self._events is not None:
            self._events[0].record()

    def forward_done(self, replayed: bool) -> None:
        self.replayed = replayed
        if self._events is not None:
            self._events[1].record()
            self._forward_timed = True

    def end(self, batch) -> None:
        """Close the step that ran ``batch`` (a list of ScheduledSeq) and keep its record."""
        self.mark(self._phase)
        gpu = None
        if self._forward_timed:
            self._events[1].synchronize()  # already done after a sampling step; a prefill-only chunk may not be
            gpu = self._events[0].elapsed_time(self._events[1])
        decode = all(s.num_tokens == 1 and not s.seq.num_draft_tokens for s in batch)
        self.records.append(StepRecord(self._last - self._start, self._acc, gpu, len(batch), decode, self.replayed))
