"""Operator reconcile benchmark: the kubellm operator (kopf + handlers.py) in-process against kmock.

Starts kmock (with the server-side-apply/generateName additions of operator/testing.py) and
the operator in one event loop, creates N LLMDeployments from examples/llmdeployment-cpu.yaml (unique names
and uids) as fast as the emulator accepts them, and measures:

* wall time from the first create until every LLMDeployment has its owned Deployment, Service and PDB;
* per LLMDeployment, the latency from its own create to all three children existing (p50/p99/max);
* the process's peak RSS (``ru_maxrss``: the operator *and* kmock, they share the process) and, with
  ``--tracemalloc``, the Python-heap peak (slows everything down, so off by default).

Run ``python benchmarks/operator_kmock.py --help``; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import platform
import resource
import sys
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path

import kmock
import kopf
import kubernetes.config.kube_config
import yaml
from tqdm import tqdm

from kubellm.operator import testing as t

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "examples" / "llmdeployment-cpu.yaml"


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def bodies(count: int) -> list[dict]:
    template = yaml.safe_load(TEMPLATE.read_text())
    out = []
    for i in range(count):
        body = copy.deepcopy(template)
        body["metadata"] = {
            "name": f"{template['metadata']['name']}-{i:04d}",
            "namespace": t.NS,
            "uid": str(uuid.uuid4()),
            "generation": 1,
            "resourceVersion": "1",
        }
        out.append(body)
    return out


def owner_uids(server, res) -> set[str]:
    uids = set()
    for (r, ns, _), obj in list(server.objects.items()):
        if r == res and ns == t.NS and not obj.deleted:
            for ref in obj.raw.get("metadata", {}).get("ownerReferences") or []:
                if ref.get("controller"):
                    uids.add(ref.get("uid"))
    return uids


async def start_operator(server, kubeconfig: Path):
    """The test suite's in-process operator (its fixture's parts), with the operator's normal timings."""
    t.write_kubeconfig(server, kubeconfig, user="bench")
    kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(kubeconfig)
    _, stop, runner, ignored = await t.start_operator()
    ignored.add(asyncio.current_task())
    return stop, runner


async def bench(args) -> dict:
    result: dict = {"count": args.count, "complete": 0, "timed_out": False}
    rss_before = rss_mib()
    async with t.ApiServer() as server, kmock.Server(server):
        t.declare_resources(server)
        with tempfile.TemporaryDirectory() as tmp:
            stop, runner = await start_operator(server, Path(tmp) / "kubeconfig")
            try:
                result.update(await create_and_wait(server, args))
            finally:
                stop.set()
                try:
                    await asyncio.wait_for(runner, timeout=30)
                except (TimeoutError, asyncio.CancelledError):
                    runner.cancel()
    result["rss_before_mib"] = rss_before
    result["rss_peak_mib"] = rss_mib()
    return result


async def create_and_wait(server, args) -> dict:
    loop = asyncio.get_running_loop()
    todo = bodies(args.count)
    created: dict[str, float] = {}
    done: dict[str, float] = {}
    deadline = loop.time() + args.timeout
    t0 = loop.time()
    for body in todo:
        created[body["metadata"]["uid"]] = loop.time()
        await t.create(server, body)
    create_s = loop.time() - t0
    with tqdm(total=args.count, desc="children ready", unit="llmd", file=sys.stderr) as bar:
        while len(done) < args.count and loop.time() < deadline:
            now = loop.time()
            ready = owner_uids(server, t.DEPLOYMENTS) & owner_uids(server, t.SERVICES)
            ready &= owner_uids(server, t.PDBS)
            for uid in ready & created.keys() - done.keys():
                done[uid] = now
                bar.update(1)
            if len(done) < args.count:
                await asyncio.sleep(args.poll)
    latencies = [done[uid] - created[uid] for uid in done]
    out = {
        "complete": len(done),
        "timed_out": len(done) < args.count,
        "create_s": create_s,
        "all_children_s": (max(done.values()) - t0) if done else None,
        "requests": len(list(server)),
    }
    if latencies:
        out.update(
            latency_p50_s=percentile(latencies, 50),
            latency_p99_s=percentile(latencies, 99),
            latency_max_s=max(latencies),
        )
    return out


def table(r: dict) -> str:
    def s(key: str) -> str:
        value = r.get(key)
        return "-" if value is None else f"{value:.3f}"

    heap = f"{r['tracemalloc_peak_mib']:.1f}" if r.get("tracemalloc_peak_mib") is not None else "-"
    rows = [
        "| N | complete | create all s | all children s | p50 s | p99 s | max s | API requests "
        "| peak RSS MiB (before) | tracemalloc peak MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r['count']} | {r['complete']} | {s('create_s')} | {s('all_children_s')} | {s('latency_p50_s')} "
        f"| {s('latency_p99_s')} | {s('latency_max_s')} | {r.get('requests', '-')} "
        f"| {r['rss_peak_mib']:.1f} ({r['rss_before_mib']:.1f}) | {heap} |",
    ]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=20, help="LLMDeployments to create (default 20)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for children (120)")
    parser.add_argument("--poll", type=float, default=0.02, help="seconds between checks of kmock (0.02)")
    parser.add_argument("--tracemalloc", action="store_true", help="also measure the Python-heap peak (slow)")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    if args.tracemalloc:
        tracemalloc.start()
    wall = time.perf_counter()
    result = asyncio.run(bench(args))
    result["wall_s"] = time.perf_counter() - wall
    result["tracemalloc_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20 if args.tracemalloc else None
    result["python"] = platform.python_version()
    result["kopf"] = kopf.__version__ if hasattr(kopf, "__version__") else None
    print(table(result))
    if result["timed_out"]:
        print(f"timed out after {args.timeout:.0f} s: {result['complete']}/{args.count} complete")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["timed_out"] else 0


if __name__ == "__main__":
    sys.exit(main())
