"""Command-line checks shared by the benchmark scripts (run as `python benchmarks/<script>.py`)."""

from __future__ import annotations

import argparse


def check_systems_and_workload(p: argparse.ArgumentParser, args: argparse.Namespace, systems: tuple[str, ...],
                               defaults: tuple[str, ...] | None = None) -> None:
    """Parse --systems (vllm* only with --vllm-venv; without --systems: ``defaults``, else all) and check the
    request/length ranges; p.error() on nonsense."""
    if args.systems:
        args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        unknown = [s for s in args.systems if s not in systems]
        if unknown:
            p.error(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(systems)}")
        if any(s.startswith("vllm") for s in args.systems) and not args.vllm_venv:
            p.error("--systems vllm needs --vllm-venv PATH")
    else:
        args.systems = [s for s in defaults or systems if not s.startswith("vllm") or args.vllm_venv]
    if args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    if not 1 <= args.min_input <= args.max_input:
        p.error("need 1 <= --min-input <= --max-input")
    if not 1 <= args.min_output <= args.max_output:
        p.error("need 1 <= --min-output <= --max-output")
