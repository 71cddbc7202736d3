"""The ``kubellm`` command: serve, demo, offline generation, models, kernels, and the operator (crd, render)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from kubellm.runtime.engine import settings as engine_settings

DEMO_QUESTION = "What is the capital of France?"
ATTENTION_BACKENDS = engine_settings.ATTENTION_BACKENDS


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        entry.update(getattr(record, "fields", None) or {})  # structured values a message carries (extra=)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """``--model`` and one flag per setting of :data:`engine_settings.ENGINE_SETTINGS` (dest: its name)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2",
                   help="a known model name (see `kubellm models list`), a Hugging Face folder or a .gguf file "
                        "(default: smollm2, the SmolLM2-135M-Instruct demo model)")
    for s in engine_settings.ENGINE_SETTINGS:
        if s.flag is None:
            continue
        if s.type is bool:  # --no-X turns the setting off; --X is a pair, --X/--no-X
            pair = not s.flag.startswith("--no-")
            g.add_argument(s.flag, dest=s.name, action=argparse.BooleanOptionalAction if pair else "store_false",
                           default=s.default, help=s.help)
            continue
        default = (os.environ.get(s.env) if s.env else None) or s.default
        g.add_argument(s.flag, dest=s.name, type=s.type, default=default, choices=s.choices, metavar=s.metavar,
                       help=s.help)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments from the parsed engine flags (everything but the model)."""
    return {s.name: getattr(args, s.name) for s in engine_settings.ENGINE_SETTINGS if s.flag is not None}


def cmd_generate(args: argparse.Namespace) -> int:
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.sampling.params import SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, stop=args.stop or [])
    texts = args.prompt or [DEMO_QUESTION]
    start = time.perf_counter()
    if args.raw:
        outputs = llm.generate(texts, params, use_tqdm=False)
    else:
        outputs = llm.chat([[{"role": "user", "content": t}] for t in texts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_tokens = sum(len(o.token_ids) for o in outputs)
    for text, out in zip(texts, outputs, strict=True):
        print(f"> {text}\n{out.text.strip()}\n")
    print(f"[{len(outputs)} request(s), {n_tokens} tokens in {elapsed:.2f}s, {n_tokens / elapsed:.1f} tok/s]",
          file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from kubellm.runtime.engine.config import EngineConfig
    from kubellm.runtime.server.app import ServerOptions
    from kubellm.runtime.server.auth import api_keys_from
    from kubellm.runtime.server.main import run_server

    name = args.served_model_name or (args.model if "/" not in args.model else args.model.rstrip("/").split("/")[-1])
    options = ServerOptions(served_model_name=name, max_queue=args.max_queue, drain_timeout=args.drain_timeout,
                            probe_timeout=args.probe_timeout, probe_skip_window=args.probe_skip_window,
                            liveness_timeout=args.liveness_timeout, api_keys=api_keys_from(args.api_key),
                            tool_call_parser=args.tool_call_parser)
    config = EngineConfig(model=args.model, **engine_kwargs(args))
    if config.node_rank > 0:  # a worker node of a multi-node group: its ranks only, no server
        from kubellm.runtime.distributed import parallel
        try:
            return parallel.run_node(config)
        except Exception as e:  # noqa: BLE001 - rank 0 gone or unreachable: one line, then the pod restarts
            logging.getLogger("kubellm.parallel").error("node %d left the tensor-parallel group: %s",
                                                        config.node_rank, e)
            return 1
    admin_port = None if args.admin_port < 0 else args.admin_port
    return asyncio.run(run_server(config, options, args.host, args.port, admin_port=admin_port))


def cmd_demo(args: argparse.Namespace) -> int:
    """Serve the demo model, ask it the demo question through the HTTP API, print the streamed answer."""
    import asyncio
    import threading
    import urllib.request

    from kubellm.runtime.engine.config import EngineConfig
    from kubellm.runtime.models import store as model_store
    from kubellm.runtime.server.app import ServerOptions
    from kubellm.runtime.server.main import run_server

    path = model_store.resolve(args.model, pull_missing=True)
    url = f"http://127.0.0.1:{args.port}"

    def ask(state) -> None:
        body = json.dumps({"model": "smollm2", "stream": True, "temperature": 0, "max_tokens": 64,
                           "messages": [{"role": "user", "content": DEMO_QUESTION}]}).encode()
        request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        print(f"\n> {DEMO_QUESTION}\n", flush=True)
        with urllib.request.urlopen(request, timeout=120) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices", []):
                        print(choice["delta"].get("content", ""), end="", flush=True)
        print("\n")
        if args.exit:
            state.on_drain("demo finished")
            return
        print(f"kubellm is serving {path.name} at {url}/v1 (OpenAI API). Try:\n"
              f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
              f"    -d '{{\"model\": \"smollm2\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}]}}'\n"
              f"Health: {url}/health/ready  Metrics: {url}/metrics  Stop: Ctrl-C (drains first)\n", flush=True)

    def on_ready(state) -> None:
        threading.Thread(target=ask, args=(state,), daemon=True).start()

    config = EngineConfig(model=str(path), **engine_kwargs(args))
    options = ServerOptions(served_model_name="smollm2", drain_timeout=5)
    # The demo drains in-process, so it needs no admin listener (and cannot collide with a server on 8001).
    return asyncio.run(run_server(config, options, "127.0.0.1", args.port, on_ready=on_ready, admin_port=None))


def cmd_models(args: argparse.Namespace) -> int:
    from kubellm.runtime.models import store as model_store
    if args.models_cmd == "pull":
        path = model_store.pull(args.name)
        print(path)
    elif args.models_cmd == "download":
        print(model_store.download_hf(args.uri, args.dest, args.revision))
    elif args.models_cmd == "list":
        for name, cached in model_store.list_models():
            print(f"{name}\t{'cached' if cached else 'not pulled'}")
    elif args.models_cmd == "export":
        from kubellm.runtime.engine.config import parse_dtype

        print(model_store.export_hf(args.name, args.out, dtype=parse_dtype(args.dtype)))
    return 0


def cmd_crd(args: argparse.Namespace) -> int:
    if args.reference:
        from kubellm.operator.crd.reference import main as crd_main
    else:
        from kubellm.operator.crd.schema import main as crd_main

    return crd_main(["-o", args.output] if args.output else [])


def cmd_kernels(args: argparse.Namespace) -> int:
    from kubellm.kernels import cpu_extension

    if args.kernels_cmd == "build":
        # One process per -march: the ops can be loaded into a process only once. Absolute, so the printed
        # paths of the libraries are too.
        import subprocess

        code = "import sys; from kubellm.kernels.cpu_extension import build_portable; print(build_portable(*sys.argv[1:]))"
        out = os.path.abspath(args.out)
        for march in args.march:
            if subprocess.run([sys.executable, "-c", code, out, march]).returncode != 0:
                print(f"kubellm kernels build: building for -march={march} failed", file=sys.stderr)
                return 1
        return 0
    import torch

    from kubellm.runtime.layers import kernel_choice
    ok = cpu_extension.available()
    info = cpu_extension.build_info()
    print(f"native CPU kernels: {'loaded' if ok else 'unavailable'}")
    print(f"library: {info['library'] or '-'}")
    print(f"error: {info['error'] or '-'}")
    cap = cpu_extension.isa_cap()
    print(f"x86-64 levels of this CPU: {', '.join(cpu_extension.supported_levels()) or 'none'}"
          + (f" (capped by {cpu_extension.ISA_ENV}={cap})" if cap else ""))
    print(f"build directory (for -march={cpu_extension._march()}): {info['build_directory']}")
    print("what --device cpu runs, by dtype (auto settings):")
    for dtype in (torch.bfloat16, torch.float32):
        print("\n".join(kernel_choice.cpu_report(dtype)))
    return 0 if ok else 1


def cmd_render(args: argparse.Namespace) -> int:
    from kubellm.operator.render.cli import main as render_main

    return render_main(args.render_args)


def cmd_operator(args: argparse.Namespace) -> int:
    from kubellm.operator.control.handlers import run

    if bool(args.namespaces) == bool(args.all_namespaces):
        raise ValueError("pass --namespace NS (repeatable) or --all-namespaces")
    run(args.namespaces, args.all_namespaces, args.liveness or None, args.standalone,
        metrics_port=args.metrics_port, prometheus_url=args.prometheus_url,
        activator_service=args.activator_service, activator_url=args.activator_url)
    return 0


def activator_settings(args: argparse.Namespace):
    """The activator's ``Limits`` and upstream template from its flags; a flag left out takes the activator's
    own default (the parser leaves them None, so that building it does not import the operator)."""
    from kubellm.operator.activator import DEFAULT_UPSTREAM, Limits

    given = {"hold_timeout": args.hold_timeout, "max_held": args.max_held, "max_held_total": args.max_held_total,
             "max_buffered": None if args.max_buffered_mib is None else args.max_buffered_mib * 2**20}
    limits = Limits(**{name: value for name, value in given.items() if value is not None})
    return limits, args.upstream or DEFAULT_UPSTREAM


def cmd_activator(args: argparse.Namespace) -> int:
    from kubellm.operator.activator import run

    if bool(args.namespaces) == bool(args.all_namespaces):
        raise ValueError("pass --namespace NS (repeatable) or --all-namespaces")
    limits, upstream = activator_settings(args)
    run(args.host, args.port, namespaces=None if args.all_namespaces else args.namespaces, limits=limits,
        upstream_template=upstream, admin_port=args.admin_port if args.admin_port > 0 else None,
        refresh_interval=args.refresh_interval)  # fmt: skip
    return 0


LOG_LEVELS = ["debug", "info", "warning", "error"]


def _logging_flags() -> argparse.ArgumentParser:
    """The logging flags as a parent parser, so each command accepts them after its name too
    (`kubellm serve --log-format json`)."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS)
    flags.add_argument("--log-format", default=argparse.SUPPRESS, choices=["text", "json"],
                       help="json: one JSON object per log line (for log pipelines)")
    return flags


def _add_demo(sub, parents: list[argparse.ArgumentParser]) -> None:
    d = sub.add_parser("demo", parents=parents, help="serve the SmolLM2 demo model and ask it a question (CPU)",
                       description="Pulls SmolLM2-135M-Instruct if needed, starts `kubellm serve` on 127.0.0.1, "
                                   "streams the answer to 'What is the capital of France?' through the HTTP API, "
                                   "then keeps serving (Ctrl-C drains and stops) unless --exit is given.")
    add_engine_args(d)
    d.add_argument("--port", type=int, default=8000)
    d.add_argument("--exit", action="store_true", help="stop (after a drain) once the answer is printed")
    d.set_defaults(func=cmd_demo, kv_cache_memory="512MiB", max_model_len=2048)


def _add_generate(sub, parents: list[argparse.ArgumentParser]) -> None:
    g = sub.add_parser("generate", parents=parents, help="offline generation with continuous batching",
                       description="Generate answers offline. Each --prompt is a user chat message (use --raw "
                                   "for plain completion). With no prompt, asks the demo question.")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    g.add_argument("--raw", action="store_true", help="complete the prompt text as is, without the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, help="per-request sampling seed")
    g.add_argument("--stop", action="append", help="stop string; repeatable")
    g.set_defaults(func=cmd_generate)


def _add_serve(sub, parents: list[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("serve", parents=parents, help="OpenAI-compatible server with health probes, drain and metrics",
                       description="Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, "
                                   "/v1/models) with /health/{live,ready,startup}, /metrics and graceful drain on "
                                   "SIGTERM. Binds first, then loads the model (probes answer 503 until ready).")
    add_engine_args(s)
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--admin-port", type=int, default=8001,
                   help="port of the admin listener (POST /admin/drain, GET /admin/status), always bound to "
                        "127.0.0.1 so nothing outside the pod can reach it; 0 picks a free port, -1 turns it off "
                        "(default 8001). Drain is never served on --port")
    s.add_argument("--api-key", action="append", metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1/* (repeatable: any of the keys; default: "
                        "$KUBELLM_API_KEY, one key or several separated by commas; none = open). Health and "
                        "metrics stay open")
    s.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json", "mistral"],
                   help="the syntax the model writes tool calls in: hermes (Hermes, Qwen), llama3_json (Llama 3.x), "
                        "mistral; auto = read it from the chat template (default)")
    s.add_argument("--served-model-name", help="model name clients send (default: --model's last path part)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="waiting requests beyond which new ones get 429 + Retry-After (default 256)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before being aborted (default 30)")
    s.add_argument("--probe-timeout", type=float, default=10.0,
                   help="deadline of the readiness probe's 1-token generation (default 10s)")
    s.add_argument("--probe-skip-window", type=float, default=5.0,
                   help="readiness skips its probe generation if tokens were produced this recently (default 5s)")
    s.add_argument("--liveness-timeout", type=float, default=60.0,
                   help="liveness fails when the engine loop has not ticked for this long (default 60s)")
    s.set_defaults(func=cmd_serve)


def _add_operator(sub, parents: list[argparse.ArgumentParser]) -> None:
    o = sub.add_parser("operator", parents=parents, help="run the LLMDeployment operator (kopf)",
                       description="Watch LLMDeployments and reconcile their Deployments, Services, PDBs and "
                                   "autoscalers with server-side apply; report status conditions and Events.")
    o.add_argument("-n", "--namespace", action="append", dest="namespaces",
                   help="namespace (or kopf glob pattern) to watch; repeatable")
    o.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    o.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                   help="liveness endpoint URL (empty string disables)")
    o.add_argument("--standalone", action="store_true", help="no kopf peering (a single operator replica)")
    o.add_argument("--metrics-port", type=int, default=9090,
                   help="serve the operator's Prometheus metrics on this port at /metrics (default 9090; 0 disables)")
    o.add_argument("--prometheus-url", default="http://prometheus-operated.monitoring.svc:9090",
                   help="Prometheus that KEDA ScaledObjects (autoscaling.backend keda) query for the queue depth "
                        "(default http://prometheus-operated.monitoring.svc:9090)")
    o.add_argument("--activator-service", default=None, metavar="NAMESPACE/NAME",
                   help="the activator's Service: while an LLMDeployment with autoscaling.minReplicas 0 has no "
                        "ready pod, its Service is routed to this Service's ready pods (default: no activator)")
    o.add_argument("--activator-url", default=None,
                   help="the activator's admin base URL, e.g. http://kubellm-activator.kubellm-system.svc:9090; "
                        "KEDA ScaledObjects poll its /activity counts (default: none)")
    o.set_defaults(func=cmd_operator)


def _add_activator(sub, parents: list[argparse.ArgumentParser]) -> None:
    # Defaults stay None here and come from the activator's Limits in activator_settings: every command builds
    # this parser, and `kubellm serve` must not import the operator.
    a = sub.add_parser("activator", parents=parents, help="hold requests for deployments scaled to zero and wake them",
                       description="A reverse proxy that the Service of an LLMDeployment scaled to zero points at: "
                                   "it holds each request, scales the Deployment from 0 to 1, and forwards the held "
                                   "requests (streams pass through) once a pod is ready; 503 + Retry-After when "
                                   "that takes longer than --hold-timeout. It serves only LLMDeployments with "
                                   "autoscaling.minReplicas 0 in the namespaces given. See docs/autoscaling.md.")
    a.add_argument("-n", "--namespace", action="append", dest="namespaces",
                   help="namespace whose LLMDeployments it serves; repeatable")
    a.add_argument("-A", "--all-namespaces", action="store_true", help="serve every namespace's LLMDeployments")
    a.add_argument("--host", default="0.0.0.0")
    a.add_argument("--port", type=int, default=8000)
    a.add_argument("--admin-port", type=int, default=9090,
                   help="port of /healthz, /metrics and /activity/NAMESPACE/NAME (the counts KEDA reads); 0: none "
                        "(default 9090)")
    a.add_argument("--upstream",
                   help="URL of a deployment's pods, formatted with {service} (its <name>-pods Service), "
                        "{namespace} and {port} (its spec.service.port), all from the LLMDeployment, never from the "
                        "request (default http://{service}.{namespace}.svc:{port})")
    a.add_argument("--hold-timeout", type=float,
                   help="seconds a request may wait for its deployment to start before it gets 503 (default 300)")
    a.add_argument("--max-held", type=int,
                   help="requests held per deployment at most; more get 503 at once (default 1000)")
    a.add_argument("--max-held-total", type=int,
                   help="requests held for all deployments together at most (default 2000)")
    a.add_argument("--max-buffered-mib", type=int,
                   help="MiB of request bodies held in memory at once at most; more get 503 (default 64). One body "
                        "is at most 8 MiB, as in `kubellm serve`")
    a.add_argument("--refresh-interval", type=float, default=5.0,
                   help="seconds between listings of the LLMDeployments served (default 5)")
    a.set_defaults(func=cmd_activator)


def _add_crd(sub) -> None:
    c = sub.add_parser("crd", help="print the LLMDeployment CRD generated from the API types",
                       description="Generate the CustomResourceDefinition for LLMDeployment from the pydantic models "
                                   "in kubellm.operator.api (the source of truth).")
    c.add_argument("-o", "--output", help="write to this file instead of stdout")
    c.add_argument("--reference", action="store_true", help="print the API reference (Markdown, docs/crd-reference.md) instead")
    c.set_defaults(func=cmd_crd)


def _add_render(sub) -> None:
    """`render` only for the command list and its help: main() hands `kubellm render ...` to the renderer's
    own parser before this one runs."""
    r = sub.add_parser("render", help="print the manifests the operator would apply for LLMDeployment files",
                       description="Render LLMDeployment YAML into the exact child manifests the operator applies "
                                   "(for GitOps review): kubellm render -f FILE [-f FILE] [-n NAMESPACE]; "
                                   "`kubellm render -h` lists every flag.", add_help=False)
    r.add_argument("render_args", nargs=argparse.REMAINDER, help="-f FILE [-f FILE] [-n NAMESPACE] ...")
    r.set_defaults(func=cmd_render)


def _add_kernels(sub, parents: list[argparse.ArgumentParser]) -> None:
    k = sub.add_parser("kernels", parents=parents, help="native CPU kernels: show what loads, prebuild",
                       description="The runtime's native CPU kernels (C++ torch extension). `info` loads them "
                                   "(compiling with -march=native if needed) and reports where from; `build` "
                                   "compiles portable copies for KUBELLM_CPU_KERNELS_DIR (images without a compiler).")
    ksub = k.add_subparsers(dest="kernels_cmd", required=True, metavar="ACTION")
    ksub.add_parser("info", help="load the kernels and report the library, or why they are unavailable")
    kb = ksub.add_parser("build", help="compile for given x86-64 levels into OUT/<level>/kubellm_cpu_ops.so")
    kb.add_argument("--out", required=True, help="folder to set as KUBELLM_CPU_KERNELS_DIR")
    kb.add_argument("--march", action="append", required=True,
                    help="a -march value such as x86-64-v4 or x86-64-v3, or x86-64-v4-bf16 (v4 plus AVX512-BF16); "
                         "repeatable")
    k.set_defaults(func=cmd_kernels)


def _add_models(sub, parents: list[argparse.ArgumentParser]) -> None:
    m = sub.add_parser("models", parents=parents, help="pull, list and export models", description="Manage the local model cache "
                       "($KUBELLM_CACHE, default ~/.cache/kubellm).")
    msub = m.add_subparsers(dest="models_cmd", required=True, metavar="ACTION")
    pull = msub.add_parser("pull", help="download a known model into the cache (e.g. smollm2)")
    pull.add_argument("name")
    msub.add_parser("list", help="known models and whether they are cached")
    dl = msub.add_parser("download", help="fetch hf://org/name into a folder (what the operator's init step runs)")
    dl.add_argument("uri", help="hf://<org>/<name>")
    dl.add_argument("--revision", help="branch, tag or commit (default: main)")
    dl.add_argument("--dest", required=True, help="folder to write the model into")
    exp = msub.add_parser("export", help="write a model as a Hugging Face folder (for transformers/vLLM)")
    exp.add_argument("name")
    exp.add_argument("out")
    exp.add_argument("--dtype", default="bfloat16")
    m.set_defaults(func=cmd_models)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubellm", description="kubellm: serve LLMs on Kubernetes with a "
                                "paged-attention runtime. Start with `kubellm generate` (demo model, CPU).")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    p.add_argument("--log-format", default="text", choices=["text", "json"], help="json for structured logs")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    logging_flags = [_logging_flags()]
    _add_demo(sub, logging_flags)
    _add_generate(sub, logging_flags)
    _add_serve(sub, logging_flags)
    _add_operator(sub, logging_flags)
    _add_activator(sub, logging_flags)
    _add_crd(sub)
    _add_render(sub)
    _add_kernels(sub, logging_flags)
    _add_models(sub, logging_flags)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["render"]:  # the renderer owns its flags (-f, -n, ...)
        setup_logging()
        from kubellm.operator.render.cli import main as render_main

        return render_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    # argparse checks choices on the command line, not in a default taken from the environment.
    if getattr(args, "attention_backend", "auto") not in ATTENTION_BACKENDS:
        parser.error(f"KUBELLM_ATTENTION_BACKEND={args.attention_backend!r}: use one of "
                     f"{', '.join(ATTENTION_BACKENDS)}")
    setup_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        logging.getLogger("kubellm").error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
