"""Online serving benchmark: `kubellm serve` against `transformers serve` and vLLM's OpenAI server (CPU).

Protocol (the metrics of ``vllm bench serve``, scaled down for CPUs):

* N requests; request i has a prompt of ``randint(min_input, max_input)`` tokens and asks for exactly
  ``randint(min_output, max_output)`` new tokens, all from ``random.Random(seed)``. Prompts are random words
  from a fixed list, each word one token for the model's tokenizer, so the text tokenizes to exactly the
  intended ids; servers that take token-id prompts get those ids, the others get the text
  (``--prompt-format``).
* Every request is a streaming ``POST /v1/completions`` with greedy decoding, ``max_tokens`` = its output
  length and EOS disabled (``ignore_eos`` or the server's own spelling of it). The actual output token
  count comes from the stream's usage chunk (or, without one, from the number of content chunks); requests
  that produced fewer tokens than asked are counted and flagged.
* Requests arrive all at once (``--request-rate inf``) or as a Poisson process, and at most
  ``--max-concurrency`` are in flight (default 32).
* Each system is started as a subprocess on a free 127.0.0.1 port, waited on until healthy, warmed up with
  two short untimed requests, benchmarked, and stopped (SIGTERM, then SIGKILL) before the next one starts.

Run ``python benchmarks/serve.py --help`` for the systems and options; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from workload_args import check_systems_and_workload

SYSTEMS = ("kubellm", "transformers", "vllm")
WARMUP_REQUESTS, WARMUP_INPUT, WARMUP_OUTPUT = 2, 16, 4
PERCENTILES = (50, 90, 99)

# Common English words. Only those that are a single token both at the start of a text and after a space
# are used, so a prompt of n words is n tokens (plus whatever special tokens the tokenizer adds).
_WORDS_TEXT = """
the of and to in is was for on that with as by at from his her they this have had not are but be or an which
one you were all we she there been their has would when if will can more no out so what up said about into
than them time only new some could these two may first then do any like my now over such our man me even
most made after also did many before must through back years where much your way well down should because
each just those people how too little state good very make world still own see men work long here get both
between life being under never day same another know while last might us great old year off come since
against go came right used take three states himself few house use during without again place around however
home small found thought went say part once general high upon school every does got united left number
course war until always away something fact though water less public put think almost hand enough far took
head yet government system better set told nothing night end why called find going look asked later knew
point next program city business give group toward young days let room president side social given present
several order national second possible rather per face among form often important things looked early white
case john become large big need four within felt children along saw best church ever least power development
light thing seemed family interest want members others mind country area done turned although open problem
sense whole help service line kind free held table court road voice morning fire door river garden music
paper story green window summer winter market letter
"""
WORDS = _WORDS_TEXT.split()


# --------------------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------------------


@dataclass
class Request:
    text: str
    ids: list[int]
    output_len: int
    arrival_s: float = 0.0  # offset from the start of the timed run (0 for every request at rate inf)

    @property
    def input_len(self) -> int:
        return len(self.ids)


@dataclass
class Workload:
    requests: list[Request]
    warmup: list[Request]

    @property
    def input_tokens(self) -> int:
        return sum(r.input_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def digest(self) -> str:
        blob = json.dumps([[r.ids, r.output_len, round(r.arrival_s, 6)] for r in self.requests])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


class PromptBuilder:
    """Random-word prompts whose tokenization is known exactly (checked for every prompt)."""

    def __init__(self, tokenizer_file: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_file))
        self.num_special = len(self.tok.encode("").ids)  # BOS and the like, added to every prompt
        self.words = [w for w in dict.fromkeys(WORDS) if self._single(w) and self._single(" " + w)]
        if len(self.words) < 50:
            raise RuntimeError(
                f"only {len(self.words)} words of the word list are single tokens for {tokenizer_file}"
            )

    def _single(self, text: str) -> bool:
        return len(self.tok.encode(text, add_special_tokens=False).ids) == 1

    def build(self, rng: random.Random, num_tokens: int) -> tuple[str, list[int]]:
        n = max(1, num_tokens - self.num_special)
        text = " ".join(rng.choice(self.words) for _ in range(n))
        ids = self.tok.encode(text).ids
        if len(ids) != n + self.num_special:
            raise RuntimeError(f"prompt of {n} words tokenized to {len(ids)} tokens")
        return text, ids


def make_workload(args: argparse.Namespace, builder: PromptBuilder) -> Workload:
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.num_requests):
        text, ids = builder.build(rng, rng.randint(args.min_input, args.max_input))
        requests.append(Request(text, ids, rng.randint(args.min_output, args.max_output)))
    if math.isfinite(args.request_rate):
        gaps = random.Random(args.seed + 1)
        t = 0.0
        for r in requests[1:]:
            t += gaps.expovariate(args.request_rate)
            r.arrival_s = t
    warm = random.Random(args.seed + 1_000_003)  # other prompts than the timed ones: no prefix-cache hits
    warmup = [Request(*builder.build(warm, WARMUP_INPUT), WARMUP_OUTPUT) for _ in range(WARMUP_REQUESTS)]
    return Workload(requests, warmup)


# --------------------------------------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------------------------------------


@dataclass
class ServerSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    ready_path: str
    model_field: str  # the request's "model"
    token_ids: bool  # accepts `prompt: [ids]`
    body: Callable[[Request], dict]  # system-specific fields: EOS handling and the like
    notes: list[str] = field(default_factory=list)


class Server:
    """A server subprocess in its own process group, with its output in a log file."""

    running: set[Server] = set()

    def __init__(self, spec: ServerSpec, port: int, log_path: Path):
        self.spec, self.port, self.log_path = spec, port, log_path
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            log.write(f"$ {shlex.join(self.spec.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.spec.argv,
                env=self.spec.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: children (vLLM's engine core) go down with it
            )
        Server.running.add(self)

    def wait_ready(self, timeout: float) -> float:
        """Poll the readiness route until it answers 200; the seconds it took."""
        start = time.monotonic()
        deadline = start + timeout
        last = "no answer yet"
        with httpx.Client(trust_env=False, timeout=10.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.spec.name} exited with status {self.proc.returncode} while starting"
                    )
                try:
                    r = client.get(self.base + self.spec.ready_path)
                    if r.status_code == 200:
                        return time.monotonic() - start
                    last = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    last = type(e).__name__
                time.sleep(1.0)
        raise RuntimeError(f"{self.spec.name} not ready after {timeout:.0f}s (last answer: {last})")

    def stop(self, timeout: float = 30.0) -> None:
        Server.running.discard(self)
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"{self.spec.name}: no exit {timeout:.0f}s after SIGTERM; killing", file=sys.stderr)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        # Children left in the group (the leader is gone) get a few seconds, then SIGKILL.
        deadline = time.monotonic() + 10.0
        while True:
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.2)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _stop_all() -> None:
    for server in list(Server.running):
        server.stop(timeout=10.0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _venv_bin(name: str) -> str:
    """A console script next to this interpreter (the venv running the benchmark), else on PATH."""
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    import shutil

    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"`{name}` is neither next to {sys.executable} nor on PATH")
    return found


def _base_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def _kv_bytes(args: argparse.Namespace) -> int:
    from kubellm.runtime.engine.config import parse_size

    return parse_size(args.kv_cache_memory)


def _max_model_len(args: argparse.Namespace) -> int:
    return max(args.max_input + args.max_output, WARMUP_INPUT + WARMUP_OUTPUT)


def kubellm_spec(args: argparse.Namespace, model_dir: Path, port: int) -> ServerSpec:
    name = model_dir.name
    argv = [
        _venv_bin("kubellm"), "serve", "--model", str(model_dir), "--dtype", args.dtype,
        "--host", "127.0.0.1", "--port", str(port), "--admin-port", "0", "--served-model-name", name,
        "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(_max_model_len(args)), "--seed", str(args.seed),
    ]  # fmt: skip
    if args.threads:
        argv += ["--num-threads", str(args.threads)]
    argv += shlex.split(args.kubellm_args)
    return ServerSpec(
        "kubellm", argv, _base_env(args), "/health/ready", name, True, lambda r: {"ignore_eos": True}
    )


def transformers_spec(args: argparse.Namespace, model_dir: Path, port: int) -> ServerSpec:
    # The folder is passed as FORCE_MODEL: it is loaded at start-up and requests must name it (or nothing).
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[args.dtype]
    page = 256  # ContinuousBatchingConfig.page_size default
    per_block = config["num_hidden_layers"] * 2 * kv_heads * head_dim * itemsize * page
    # On a CPU, transformers would otherwise size its KV cache from most of the host's memory. Like kubellm:
    # no more blocks than max_num_seqs full-length sequences can use.
    useful = args.max_num_seqs * -(-_max_model_len(args) // page)
    blocks = max(1, min(_kv_bytes(args) // per_block, useful))
    argv = [
        _venv_bin("transformers"), "serve", str(model_dir), "--continuous-batching", "--dtype", args.dtype,
        "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--cb-num-blocks", str(blocks),
        "--cb-max-batch-tokens", str(args.max_num_batched_tokens), "--log-level", "warning",
    ]  # fmt: skip
    if args.seed is not None:
        argv += ["--default-seed", str(args.seed)]
    argv += shlex.split(args.transformers_args)

    def body(r: Request) -> dict:
        # `ignore_eos`/`min_tokens` are answered with 422 ("Unexpected fields"); the request's
        # `generation_config` (a JSON string) replaces the model's, and eos_token_id=-1 disables EOS in
        # continuous batching.
        gen = {"max_new_tokens": r.output_len, "do_sample": False, "eos_token_id": -1}
        return {"generation_config": json.dumps(gen)}

    spec = ServerSpec("transformers", argv, _base_env(args), "/health", str(model_dir), False, body)
    spec.notes.append(
        f"transformers: continuous batching, KV cache {blocks} blocks of {page} tokens, prompts sent as text"
    )
    return spec


def vllm_spec(args: argparse.Namespace, model_dir: Path, port: int) -> ServerSpec:
    python = Path(args.vllm_venv).expanduser() / "bin" / "python"
    name = model_dir.name
    env = _base_env(args)
    env.pop("PYTHONPATH", None)  # keep this venv's packages out of the child
    # vLLM's CPU backend sizes its KV cache from this variable (whole GiB).
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(_kv_bytes(args) / 2**30)))
    if args.threads:
        cpus = sorted(os.sched_getaffinity(0))[: args.threads]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name,
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(_max_model_len(args)), "--seed", str(args.seed),
    ]  # fmt: skip
    argv += shlex.split(args.vllm_args)
    spec = ServerSpec("vllm", argv, env, "/health", name, True, lambda r: {"ignore_eos": True})
    spec.notes.append(f"vllm: VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']} GiB")
    return spec


SPECS = {"kubellm": kubellm_spec, "transformers": transformers_spec, "vllm": vllm_spec}


# --------------------------------------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    start_s: float = 0.0  # when it was sent, from the start of the run
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0  # content chunks (non-empty text)
    output_tokens: int = 0
    output_from_usage: bool = False
    prompt_tokens: int | None = None  # as the server's usage reports it
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def payload(spec: ServerSpec, req: Request, prompt_format: str) -> dict:
    use_ids = spec.token_ids and prompt_format == "ids"
    body = {
        "model": spec.model_field,
        "prompt": req.ids if use_ids else req.text,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(spec.body(req))
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict, timeout: float, t0: float) -> RequestResult:
    res = RequestResult()
    start = time.perf_counter()
    res.start_s = start - t0
    last = start
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:300]
                    res.error = f"HTTP {resp.status_code}: {detail}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments (keep-alive pings)
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    event = json.loads(data)
                    if "error" in event:
                        res.error = f"stream error: {json.dumps(event['error'])[:300]}"
                        return res
                    for choice in event.get("choices") or ():
                        if choice.get("text"):
                            if res.chunks == 0:
                                res.ttft_s = now - start
                            else:
                                res.itl_s.append(now - last)
                            last = now
                            res.chunks += 1
                        if choice.get("finish_reason"):
                            res.finish_reason = choice["finish_reason"]
                    if usage := event.get("usage"):
                        if usage.get("completion_tokens") is not None:
                            res.output_tokens = int(usage["completion_tokens"])
                            res.output_from_usage = True
                        if usage.get("prompt_tokens") is not None:
                            res.prompt_tokens = int(usage["prompt_tokens"])
        res.e2e_s = time.perf_counter() - start
    except TimeoutError:
        res.error = f"timed out after {timeout:.0f}s"
        return res
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    if res.chunks == 0:
        res.error = "no content chunk in the stream"
        return res
    if not res.output_from_usage:
        res.output_tokens = res.chunks
    res.success = True
    return res


async def run_requests(
    spec: ServerSpec,
    base: str,
    requests: list[Request],
    args: argparse.Namespace,
    progress: bool,
) -> tuple[list[RequestResult], float]:
    """Send the requests at their arrival times, at most --max-concurrency at a time; (results, duration)."""
    limit = args.max_concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc=spec.name, file=sys.stderr, leave=False)
    url = base + "/v1/completions"
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()

        async def one(req: Request) -> RequestResult:
            async with sem:
                res = await send(
                    client, url, payload(spec, req, args.prompt_format), args.request_timeout, t0
                )
            if bar is not None:
                bar.update(1)
            return res

        tasks = []
        for req in requests:
            delay = t0 + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return list(results), duration


# --------------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------------


def _stats(values: list[float]) -> dict:
    """mean and percentiles in ms (linear interpolation, like numpy's default)."""
    if not values:
        return {"n": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}}
    xs = sorted(values)

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p / 100
        lo = math.floor(k)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"n": len(xs), "mean": 1000 * sum(xs) / len(xs), **{f"p{p}": 1000 * pct(p) for p in PERCENTILES}}


@dataclass
class SystemResult:
    system: str
    ok: bool = False
    error: str = ""
    startup_s: float | None = None
    duration_s: float = 0.0
    completed: int = 0
    failed: int = 0
    short: int = 0  # successful requests with fewer output tokens than asked
    prompt_mismatch: int = 0  # usage.prompt_tokens differs from the workload's prompt length
    output_from_chunks: int = 0  # requests whose output count came from content chunks (no usage)
    input_tokens: int = 0
    output_tokens: int = 0
    requested_output_tokens: int = 0
    request_throughput: float = 0.0
    output_throughput: float = 0.0
    total_token_throughput: float = 0.0
    ttft_ms: dict = field(default_factory=dict)
    tpot_ms: dict = field(default_factory=dict)
    itl_ms: dict = field(default_factory=dict)
    e2e_ms: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # the first few distinct request errors
    notes: list[str] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)


def summarize(system: str, wl: Workload, results: list[RequestResult], duration: float) -> SystemResult:
    out = SystemResult(system, ok=True, duration_s=duration)
    ttft, tpot, itl, e2e = [], [], [], []
    for req, res in zip(wl.requests, results, strict=True):
        out.requests.append(
            {
                "input_len": req.input_len,
                "output_len": req.output_len,
                "arrival_s": round(req.arrival_s, 6),
                **{k: v for k, v in asdict(res).items() if k != "itl_s"},
                "itl_s": [round(x, 6) for x in res.itl_s],
            }
        )
        if not res.success:
            out.failed += 1
            if res.error not in out.errors and len(out.errors) < 5:
                out.errors.append(res.error)
            continue
        out.completed += 1
        out.input_tokens += res.prompt_tokens if res.prompt_tokens is not None else req.input_len
        out.output_tokens += res.output_tokens
        out.requested_output_tokens += req.output_len
        out.short += res.output_tokens < req.output_len
        out.prompt_mismatch += res.prompt_tokens is not None and res.prompt_tokens != req.input_len
        out.output_from_chunks += not res.output_from_usage
        ttft.append(res.ttft_s)
        e2e.append(res.e2e_s)
        itl.extend(res.itl_s)
        if res.tpot_s is not None:
            tpot.append(res.tpot_s)
    if duration > 0:
        out.request_throughput = out.completed / duration
        out.output_throughput = out.output_tokens / duration
        out.total_token_throughput = (out.input_tokens + out.output_tokens) / duration
    out.ttft_ms, out.tpot_ms, out.itl_ms, out.e2e_ms = _stats(ttft), _stats(tpot), _stats(itl), _stats(e2e)
    if out.short:
        out.notes.append(
            f"{system}: {out.short} request(s) produced fewer tokens than asked "
            f"({out.output_tokens} of {out.requested_output_tokens} in all)"
        )
    if out.prompt_mismatch:
        out.notes.append(
            f"{system}: {out.prompt_mismatch} prompt(s) counted differently by the server's usage"
        )
    if out.output_from_chunks:
        out.notes.append(
            f"{system}: {out.output_from_chunks} request(s) had no usage; output counted in chunks"
        )
    return out


# --------------------------------------------------------------------------------------------------------
# Running one system
# --------------------------------------------------------------------------------------------------------


# The structured-output run: every request must produce JSON of this shape (long enough that max_tokens, not
# the grammar, usually ends a request, so both runs produce similar token counts).
STRUCTURED_SCHEMA = {
    "type": "object",
    "required": ["items"],
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "name", "tags"],
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
            },
        }
    },
}
STRUCTURED_SYSTEMS = ("kubellm", "vllm")  # transformers serve has no structured outputs


def structured_spec(spec: ServerSpec) -> ServerSpec:
    """The same server and requests, each constrained to STRUCTURED_SCHEMA (vLLM's structured_outputs field,
    which both kubellm and vLLM take); no ignore_eos, so a finished document can end a request."""
    return dataclasses.replace(
        spec, name=f"{spec.name} json_schema", body=lambda r: {"structured_outputs": {"json": STRUCTURED_SCHEMA}}
    )


def run_system(
    name: str, args: argparse.Namespace, model_dir: Path, wl: Workload, log_dir: Path
) -> list[SystemResult]:
    port = free_port()
    spec = SPECS[name](args, model_dir, port)
    server = Server(spec, port, log_dir / f"{name}.log")
    _header(f"{name}: starting on 127.0.0.1:{port} (log: {server.log_path})")
    print(f"$ {shlex.join(spec.argv)}", file=sys.stderr, flush=True)
    try:
        server.start()
        startup = server.wait_ready(args.startup_timeout)
        print(f"{name}: ready after {startup:.1f}s", file=sys.stderr, flush=True)
        warm, _ = asyncio.run(run_requests(spec, server.base, wl.warmup, args, progress=False))
        if bad := [r for r in warm if not r.success]:
            raise RuntimeError(f"warm-up request failed: {bad[0].error}")
        warm_tokens = [r.output_tokens for r in warm]
        print(
            f"{name}: warm-up done (output tokens {warm_tokens}); timed run ...", file=sys.stderr, flush=True
        )
        results, duration = asyncio.run(run_requests(spec, server.base, wl.requests, args, progress=True))
        result = summarize(name, wl, results, duration)
        result.startup_s = startup
        result.notes[:0] = spec.notes
        if any(t < WARMUP_OUTPUT for t in warm_tokens):
            result.notes.append(f"{name}: warm-up produced {warm_tokens} tokens for {WARMUP_OUTPUT} asked")
        out = [result]
        if args.structured and name in STRUCTURED_SYSTEMS:
            # Same process, same workload, twice more: unconstrained then constrained. Both find the prompts
            # in the prefix cache the first run filled, so they compare with each other, not with the first.
            rerun = dataclasses.replace(spec, name=f"{name} (prompts cached)")
            constrained = structured_spec(rerun)
            runs = []
            for s in (rerun, constrained):
                _header(f"{s.name}: the same workload again")
                asyncio.run(run_requests(s, server.base, wl.warmup, args, progress=False))
                results, duration = asyncio.run(run_requests(s, server.base, wl.requests, args, True))
                runs.append(summarize(s.name, wl, results, duration))
            runs[1].notes.append(_structured_note(constrained.name, results, runs[0], runs[1]))
            out += runs
        return out
    except Exception as e:  # one system failing must not stop the others
        tail = server.log_tail()
        print(f"{name}: FAILED: {e}\n--- last lines of {server.log_path} ---\n{tail}", file=sys.stderr)
        return [SystemResult(name, ok=False, error=str(e), notes=list(spec.notes))]
    finally:
        server.stop()
        print(f"{name}: stopped", file=sys.stderr, flush=True)


def _structured_note(name: str, results: list[RequestResult], free: SystemResult, constrained: SystemResult) -> str:
    finishes = {}
    for r in results:
        finishes[r.finish_reason] = finishes.get(r.finish_reason, 0) + 1
    ratio = "-"
    if free.output_throughput and constrained.output_throughput:
        ratio = f"{constrained.output_throughput / free.output_throughput:.2f}x"
    return (f"{name}: output tok/s {ratio} of the unconstrained rerun in the same server (both with the prompts "
            f"prefix-cached); finish reasons {finishes}")


def _header(text: str) -> None:
    print(f"\n=== {text} ===", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def system_table(r: SystemResult) -> str:
    if not r.ok:
        return f"### {r.system}\n\nFAILED: {r.error}\n"
    lines = [
        f"### {r.system}",
        "",
        "| | |",
        "|---|---:|",
        f"| successful requests | {r.completed} |",
        f"| failed requests | {r.failed} |",
        f"| short outputs (fewer tokens than asked) | {r.short} |",
        f"| benchmark duration (s) | {r.duration_s:.2f} |",
        f"| input tokens | {r.input_tokens} |",
        f"| output tokens (asked) | {r.output_tokens} ({r.requested_output_tokens}) |",
        f"| request throughput (req/s) | {r.request_throughput:.3f} |",
        f"| output token throughput (tok/s) | {r.output_throughput:.1f} |",
        f"| total token throughput (tok/s) | {r.total_token_throughput:.1f} |",
        f"| server start-up (s) | {_f(r.startup_s)} |",
        "",
        "| ms | mean | p50 | p90 | p99 |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, s in (("TTFT", r.ttft_ms), ("TPOT", r.tpot_ms), ("ITL", r.itl_ms), ("E2E latency", r.e2e_ms)):
        lines.append(f"| {label} | {_f(s['mean'])} | {_f(s['p50'])} | {_f(s['p90'])} | {_f(s['p99'])} |")
    if r.errors:
        lines += ["", "Request errors: " + "; ".join(r.errors)]
    return "\n".join(lines) + "\n"


def comparison_table(results: list[SystemResult], baseline: str) -> str:
    base = next((r for r in results if r.system == baseline and r.ok and r.completed), None)
    lines = [
        f"| system | ok / failed | short | output tok/s | total tok/s | req/s | TTFT p50 ms | TTFT p99 ms "
        f"| TPOT p50 ms | TPOT p99 ms | E2E p99 ms | output tok/s vs {baseline} | TTFT p99 vs {baseline} |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if not r.ok:
            lines.append(f"| {r.system} | FAILED | | | | | | | | | | | |")
            continue
        ratio = ttft_ratio = "-"
        if base is not None and base.output_throughput > 0:
            ratio = f"{r.output_throughput / base.output_throughput:.2f}x"
        if base is not None and base.ttft_ms["p99"] and r.ttft_ms["p99"] is not None:
            ttft_ratio = f"{r.ttft_ms['p99'] / base.ttft_ms['p99']:.2f}x"
        lines.append(
            f"| {r.system} | {r.completed} / {r.failed} | {r.short} | {r.output_throughput:.1f} "
            f"| {r.total_token_throughput:.1f} | {r.request_throughput:.3f} | {_f(r.ttft_ms['p50'])} "
            f"| {_f(r.ttft_ms['p99'])} | {_f(r.tpot_ms['p50'])} | {_f(r.tpot_ms['p99'])} "
            f"| {_f(r.e2e_ms['p99'])} | {ratio} | {ttft_ratio} |"
        )
    return "\n".join(lines) + "\n"


def settings_text(settings: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())


def environment(args: argparse.Namespace) -> dict:
    from importlib import metadata

    env = {"python": platform.python_version(), "cpu_count": os.cpu_count(), "httpx": httpx.__version__}
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        env["cpu"] = platform.processor()
    with contextlib.suppress(OSError):
        env["loadavg"] = os.getloadavg()
    for pkg in ("kubellm", "transformers", "torch"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            env[pkg] = metadata.version(pkg)
    if args.vllm_venv:
        python = Path(args.vllm_venv).expanduser() / "bin" / "python"
        code = (
            "from importlib import metadata as m\n"
            "for p in ('vllm', 'vllm-cpu'):\n"
            "    try: print(m.version(p)); break\n"
            "    except m.PackageNotFoundError: pass"
        )
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [str(python), "-c", code],
                capture_output=True,
                text=True,
                timeout=60,
            )
            env["vllm"] = out.stdout.strip() or None
    return env


# --------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks/serve.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Online serving benchmark (like `vllm bench serve`): kubellm serve against transformers "
        "serve and vLLM's OpenAI server, over HTTP on 127.0.0.1.",
        epilog="""\
protocol:
  N streaming /v1/completions requests, prompt lengths uniform in [min-input, max-input] tokens
  and output lengths uniform in [min-output, max-output], from random.Random(seed): the same for
  every system (workload_sha256 is printed). Prompts are random words that are one token each, so
  the text tokenizes to exactly the intended ids; --prompt-format ids sends those ids to servers
  that take token-id prompts (kubellm, vllm) and the text to the others. Greedy, EOS disabled,
  max_tokens = the output length. Requests arrive at once (--request-rate inf) or as a Poisson
  process, at most --max-concurrency in flight. Each system is started on a free loopback port,
  waited on until healthy, warmed up with 2 short requests, timed, and stopped before the next.

metrics (per system):
  TTFT  time from sending to the first chunk with text
  ITL   gaps between consecutive chunks with text (all requests pooled)
  TPOT  (E2E - TTFT) / (output tokens - 1), per request with more than one output token
  E2E   time from sending to the end of the stream
  throughput = successful requests, output tokens (from the usage chunk) or prompt + output
  tokens, divided by the duration (first request sent to last response finished).

systems:
  kubellm       kubellm serve (ready: GET /health/ready == 200)
  transformers  transformers serve --continuous-batching with the folder as FORCE_MODEL (GET /health);
                prompts as text, EOS disabled through the request's generation_config
  vllm          vLLM's OpenAI server from --vllm-venv (GET /health); minutes to start on a CPU""",
    )
    p.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: "
        "kubellm,transformers, plus vllm with --vllm-venv)",
    )
    p.add_argument("--baseline", default="transformers", choices=SYSTEMS, help="system the ratios refer to")
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face folder (default: <kubellm cache>/hf/smollm2-<dtype>, "
        "exported from kubellm's smollm2 if missing; cache: $KUBELLM_CACHE or ~/.cache/kubellm)",
    )
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-input", type=int, default=32)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=32,
        help="most requests in flight (default %(default)s; 0 = no limit)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--structured",
        action="store_true",
        help="after each kubellm/vllm run, time the same workload again in the same server with every request "
        "constrained to a JSON schema (structured_outputs.json); reports tok/s against the unconstrained run",
    )
    p.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="ids",
        help="ids: token-id prompts where the server takes them (default); text: text everywhere",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads per server (OMP_NUM_THREADS; kubellm --num-threads; vLLM "
        "VLLM_CPU_OMP_THREADS_BIND); default: each server's own choice",
    )
    p.add_argument(
        "--kv-cache-memory",
        default="1GiB",
        help="KV-cache budget of every server (vLLM: rounded up to whole GiB; transformers: "
        "converted to --cb-num-blocks); default %(default)s",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="kubellm and vLLM --max-num-seqs")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens per engine step (kubellm, vLLM; transformers --cb-max-batch-tokens)",
    )
    p.add_argument("--vllm-venv", default=None, help="venv with vllm-cpu installed; enables the vllm system")
    p.add_argument(
        "--kubellm-args",
        default="",
        help='extra arguments for `kubellm serve`, one string: --kubellm-args="--block-size 32"',
    )
    p.add_argument("--transformers-args", default="", help="extra arguments for `transformers serve`")
    p.add_argument("--vllm-args", default="", help="extra arguments for vLLM's api_server")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds a server gets to become healthy (default %(default)s; vLLM's CPU build takes minutes)",
    )
    p.add_argument(
        "--request-timeout", type=float, default=900.0, help="seconds per request (default %(default)s)"
    )
    p.add_argument("--log-dir", default=None, help="where server logs go (default: a new temporary folder)")
    p.add_argument("--json", metavar="PATH", help="write settings, environment and results (per request too)")
    p.add_argument("--markdown", metavar="PATH", help="write the tables, settings and notes as Markdown")
    args = p.parse_args(argv)

    check_systems_and_workload(p, args, SYSTEMS)
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf: all at once)")
    if args.max_concurrency < 0:
        p.error("--max-concurrency must be >= 0")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    try:
        _kv_bytes(args)
    except ValueError as exc:
        p.error(f"--kv-cache-memory: {exc}")
    if args.vllm_venv and not (Path(args.vllm_venv).expanduser() / "bin" / "python").is_file():
        p.error(f"--vllm-venv {args.vllm_venv}: no bin/python in it")
    return args


def prepare_model(model: str | None, dtype: str) -> Path:
    """--model as given, else <kubellm cache>/hf/smollm2-<dtype> (exported from kubellm's smollm2)."""
    if model:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
            raise SystemExit(
                f"--model {model}: not a Hugging Face folder with config.json and tokenizer.json"
            )
        return path.resolve()
    import torch

    from kubellm.runtime.models import store as model_store
    return model_store.cached_hf_export("smollm2", getattr(torch, dtype))


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    atexit.register(_stop_all)
    signal.signal(signal.SIGTERM, _on_sigterm)
    model_dir = prepare_model(args.model, args.dtype)
    builder = PromptBuilder(model_dir / "tokenizer.json")
    wl = make_workload(args, builder)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kubellm-serve-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "model": str(model_dir),
        "dtype": args.dtype,
        "num_requests": args.num_requests,
        "input_range": [args.min_input, args.max_input],
        "output_range": [args.min_output, args.max_output],
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency or None,
        "seed": args.seed,
        "prompt_format": args.prompt_format,
        "threads": args.threads,
        "kv_cache_memory": args.kv_cache_memory,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "input_tokens": wl.input_tokens,
        "output_tokens": wl.output_tokens,
        "workload_sha256": wl.digest(),
    }
    print(f"settings: {settings_text(settings)}", file=sys.stderr)
    print(f"server logs: {log_dir}", file=sys.stderr)

    results = []
    try:
        for name in args.systems:
            results.extend(run_system(name, args, model_dir, wl, log_dir))
    finally:
        _stop_all()

    notes = [n for r in results for n in r.notes]
    notes.append(
        f"{len(builder.words)} single-token words; prompt lengths include {builder.num_special} "
        "special token(s) the tokenizer adds"
    )
    sections = [system_table(r) for r in results]
    report = (
        "## Serving benchmark\n\n"
        f"Settings: {settings_text(settings)}\n\n"
        + "\n".join(sections)
        + "\n### Comparison\n\n"
        + comparison_table(results, args.baseline)
        + "\nNotes:\n\n"
        + "\n".join(f"- {n}" for n in notes)
        + "\n"
    )
    print(report)
    if args.markdown:
        Path(args.markdown).write_text(report)
    if args.json:
        doc = {
            "settings": settings,
            "environment": environment(args),
            "results": [asdict(r) for r in results],
            "notes": notes,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
    return 0 if all(r.ok and not r.failed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
