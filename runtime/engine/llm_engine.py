"""The engine: requests in, tokens out. ``step()`` is the whole loop: schedule → run → postprocess.

``LLMEngine`` is what the server drives (one step at a time, from its own thread); ``LLM`` is the
offline API (``LLM(model).generate(prompts, SamplingParams(...))``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kubellm.runtime.distributed import parallel
from kubellm.runtime.distributed.tp_group import Group, check_divisible
from kubellm.runtime.engine import cuda_graphs, host_malloc, step_timer
from kubellm.runtime.engine.block_manager import BlockManager
from kubellm.runtime.engine.config import EngineConfig, available_memory_bytes
from kubellm.runtime.engine.model_runner import ModelRunner, kv_block_bytes
from kubellm.runtime.engine.scheduler import Scheduler
from kubellm.runtime.engine.sequence import FinishReason, Sequence
from kubellm.runtime.layers import kernel_choice
from kubellm.runtime.models.config import ModelConfig, text_tower_config
from kubellm.runtime.models.loader import build_model, keeps_gguf_packed, read_checkpoint
from kubellm.runtime.quantization.registry import check_checkpoint, log_weight_bytes, quantize_model
from kubellm.runtime.sampling.params import InvalidSamplingParams, SamplingParams
from kubellm.runtime.sampling.sampler import Sampler, TokenLogprobs
from kubellm.runtime.sampling.structured_output import StructuredOutputs
from kubellm.runtime.spec_decode.factory import make_proposer
from kubellm.runtime.spec_decode.proposer import SpeculationStats
from kubellm.runtime.spec_decode.speculator import Speculator
from kubellm.runtime.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kubellm.runtime.text.tokenizer import Tokenizer

log = logging.getLogger("kubellm.engine")

CPU_DEFAULT_KV_CACHE = 4 * 2**30  # like vLLM's CPU build: a fixed budget, not a fraction of host RAM


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """A request's state after a step. ``new_*`` hold what this step added (for streaming)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_cached_tokens: int
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when the request asked for them
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token (the first: None)
    error: str | None = None  # why the engine ended the request (finish_reason "abort"), for the client


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's queues and KV cache: what the server, its metrics and probes read."""

    num_waiting: int
    num_running: int
    waiting_prompt_tokens: int  # tokens of the queued sequences (prompts, or prompt + output when preempted)
    kv_blocks_total: int
    kv_blocks_used: int
    kv_usage: float  # kv_blocks_used / kv_blocks_total
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of which served from it
    num_preemptions: int
    speculation: SpeculationStats | None = None  # None without speculative decoding


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher | None
    metrics: RequestMetrics
    emitted_text: int = 0  # chars of text already handed out in new_text
    emitted_tokens: int = 0
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=lambda: [None])  # nothing predicts token 0
    error: str | None = None


def _max_model_len(ckpt, config: EngineConfig) -> int:
    max_pos = text_tower_config(ckpt.config).get("max_position_embeddings") or 2048
    return min(config.max_model_len or max_pos, max_pos)


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True):
        from kubellm.runtime.models.store import resolve

        if config.device == "cpu":
            host_malloc.tune()  # recycle activation buffers instead of page-faulting them in every step
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        path = resolve(config.model)
        self.config = config = dataclasses.replace(config, model=str(path))  # ranks 1.. load this very path
        ckpt = read_checkpoint(path)
        self.tokenizer = Tokenizer.from_checkpoint(ckpt)
        self.model_path = path
        self.max_model_len = _max_model_len(ckpt, config)
        cfg = ModelConfig.from_hf(ckpt.config, ckpt.source)
        check_checkpoint(config.quantization, ckpt.config, ckpt.source)
        check_divisible(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, config.tensor_parallel_size)
        self.kernels = kernel_choice.for_engine(config, cfg, config.tensor_parallel_size)  # every rank's
        self.tp = Group(device=config.device)
        if config.tensor_parallel_size > 1:
            self.tp = parallel.start(config, self.max_model_len, self.kernels)
        try:
            model, self.model_config = build_model(ckpt, config.dtype, self.tp.device, self.max_model_len, progress,
                                                   tp=self.tp, kernels=self.kernels,
                                                   keep_packed=keeps_gguf_packed(config.quantization))
            quantize_model(model, config.quantization, self.kernels)  # before the KV cache is sized from what is left
            self.weight_bytes = log_weight_bytes(model)
            proposer = make_proposer(config, model, self.model_config, self.tokenizer, self.max_model_len,
                                     self.kernels, self.tp.device, progress)  # None without speculative decoding
            # A proposer's own pool has as many blocks as the main one: each block's cost is both.
            num_blocks = self._num_kv_blocks(proposer.kv_block_bytes() if proposer else 0)
            if self.tp.size > 1:  # every rank's pool has rank 0's block count: one scheduler serves them all
                self.tp.broadcast(num_blocks)
            graph_plan = cuda_graphs.plan(config, model, self.max_model_len)  # + a scratch block for padding rows
            self.runner = ModelRunner(model, self.model_config, num_blocks + graph_plan.scratch_blocks,
                                      config.block_size, config.dtype, self.tp.device,
                                      Sampler(self.tokenizer.eos_token_ids), self.kernels)
            self.cuda_graphs = cuda_graphs.start(self.runner, graph_plan, num_blocks, self.max_model_len)
        except BaseException:
            self.tp.shutdown()
            raise
        reads_hidden = proposer is not None and proposer.reads_hidden_states
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          recompute_last_hit_block=reads_hidden)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.enable_chunked_prefill)
        self.speculator = None
        if proposer is not None:
            proposer.allocate(num_blocks)
            self.speculator = Speculator(proposer, self.block_manager, self.max_model_len)
            self.runner.keep_hidden = reads_hidden
        self.requests: dict[str, _Request] = {}
        tp_note = f", tensor parallel x{self.tp.size} (per rank)" if self.tp.size > 1 else ""
        log.info("engine ready: %s, dtype=%s, max_model_len=%d, %d KV blocks of %d tokens (%.0f MiB%s)",
                 path, str(config.dtype).removeprefix("torch."), self.max_model_len, num_blocks, config.block_size,
                 num_blocks * kv_block_bytes(self.model_config, config.block_size, config.dtype, self.tp.size) / 2**20,
                 tp_note)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without them). Call on the thread that steps."""
        self.tp.shutdown()

    def workers_alive(self) -> bool:
        """Whether every tensor-parallel rank process is still running (always, without tensor parallelism)."""
        return self.tp.workers_alive()

    def _num_kv_blocks(self, draft_block_bytes: int = 0) -> int:
        c = self.config
        per_block = kv_block_bytes(self.model_config, c.block_size, c.dtype, self.tp.size) + draft_block_bytes
        if c.num_kv_blocks:
            return c.num_kv_blocks
        if c.kv_cache_memory:
            budget = c.kv_cache_memory
        else:
            budget = int(available_memory_bytes(c.device) * c.kv_cache_memory_fraction)
            if c.device == "cpu":
                budget = min(budget, CPU_DEFAULT_KV_CACHE)
        # More blocks than every sequence at full length could use is wasted memory.
        useful = c.max_num_seqs * -(-self.max_model_len // c.block_size)
        n = min(budget // per_block, useful)
        if n < -(-self.max_model_len // c.block_size):
            log.warning("the KV cache (%d blocks) cannot hold one full-length (%d tokens) sequence; "
                        "long requests will be refused", n, self.max_model_len)
        if n < 1:
            raise ValueError(f"KV-cache budget of {budget} bytes is below one block ({per_block} bytes); "
                             "raise --kv-cache-memory")
        return int(n)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; raises ValueError subclasses (RequestTooLong...) for ones that can never run."""
        params = params or SamplingParams()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(prompt_ids, params)
        seq = Sequence(prompt_ids, params, request_id)
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if params.guided is not None:
            seq.grammar = self.structured_outputs.matcher(params.guided)
        self.scheduler.add(seq)
        stops = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        self.requests[seq.request_id] = _Request(
            seq, IncrementalDetokenizer(self.tokenizer.tk, prompt_ids, params.skip_special_tokens), stops,
            RequestMetrics(arrival_time=time.monotonic()))
        return seq.request_id

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (RequestTooLong for length problems) if this request can never run.

        Reads configuration only, so a server thread may call it before queueing the request.
        """
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.logit_bias or {} if t >= vocab), None)
        if bad is not None:
            raise InvalidSamplingParams("logit_bias", f"token id {bad} is outside the vocabulary [0, {vocab})")
        self.scheduler.check_request(len(prompt_ids), params.max_tokens)
        if params.guided is not None:
            self.structured_outputs.check(params.guided)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req.seq, FinishReason.ABORT)
        return self._output(req)

    def abort_all(self) -> list[RequestOutput]:
        """Abort every unfinished request; returns their final outputs."""
        return [out for rid in list(self.requests) if (out := self.abort_request(rid)) is not None]

    def warmup(self) -> float:
        """Run one full-budget prefill (and a decode) on a throwaway prompt; returns the seconds it took.

        A fresh process pays for first use on its first big step (oneDNN builds kernels per GEMM shape, the
        allocator grows): here the first 2048-token step took 1.2 s instead of 0.7 s. A server pays that at
        start-up instead of in the TTFT of its first burst of requests.
        """
        start = time.monotonic()
        bm, sched = self.block_manager, self.scheduler
        budget = min(sched.max_num_batched_tokens, (bm.num_blocks - sched.max_num_seqs) * bm.block_size)
        per_prompt = self.max_model_len - 2  # room for the decode
        vocab = self.model_config.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        for i in range(min(sched.max_num_seqs, -(-budget // per_prompt)) if budget > 0 and per_prompt > 0 else 0):
            n = min(per_prompt, budget - i * per_prompt)
            self.add_request([(j * 7919 + 13 * i) % vocab for j in range(n)], params, f"kubellm-warmup-{i}")
        while self.has_unfinished_requests():
            self.step()
        bm.prefix_queries = bm.prefix_hits = 0  # the throwaway prompt is not traffic
        return time.monotonic() - start

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @functools.cached_property
    def structured_outputs(self) -> StructuredOutputs:
        """The grammar engine, built at the first structured-output request (or by the server at start-up)."""
        so = StructuredOutputs(self.tokenizer, self.model_config.vocab_size)
        self.runner.structured = so
        return so

    # ---- public surface for the server ---------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole KV-cache pool holds."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    @property
    def block_size(self) -> int:
        """Tokens per KV-cache block."""
        return self.block_manager.block_size

    def stats(self) -> EngineStats:
        """Call on the thread that steps; other threads read the snapshot ``AsyncEngine.stats`` keeps."""
        sched, bm = self.scheduler, self.block_manager
        waiting = list(sched.waiting)
        return EngineStats(num_waiting=len(waiting), num_running=len(sched.running),
                           waiting_prompt_tokens=sum(len(s) for s in waiting), kv_blocks_total=bm.num_blocks,
                           kv_blocks_used=bm.num_used_blocks, kv_usage=bm.usage, prefix_queries=bm.prefix_queries,
                           prefix_hits=bm.prefix_hits, num_preemptions=sched.num_preemptions,
                           speculation=dataclasses.replace(self.speculator.proposer.stats) if self.speculator
                           else None)

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        timer = self.runner.step_timer  # None unless a profiler is attached (runtime/engine/step_timer.py)
        if timer is not None:
            timer.begin()
        drafted = self.speculator.propose(self.scheduler.running) if self.speculator else []
        batch = self.scheduler.schedule()
        if drafted:
            self.speculator.trim(drafted, batch)
        if not batch:
            return []
        now = time.monotonic()
        for s in batch:
            m = self.requests[s.seq.request_id].metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        tokens, logprobs, prompt_logprobs = self.runner.run(batch)
        for seq, first, entries in prompt_logprobs:  # a recompute after preemption repeats some: skip those
            have = self.requests[seq.request_id].prompt_logprobs
            have += entries[len(have) - first :]
        new_tokens, new_logprobs = self._per_sequence(batch, tokens, logprobs)
        updated = self.scheduler.postprocess(batch, [t[-1] for t in new_tokens])  # sampled entries, in order
        if self.speculator is not None:  # before stops end sequences: their blocks may enter the prefix cache
            self.speculator.observe(batch, self.runner.last_hidden)
        if timer is not None:
            timer.mark(step_timer.DETOKENIZE)
        outs = [self._process_tokens(seq, t, lp) for seq, t, lp in zip(updated, new_tokens, new_logprobs, strict=True)]
        if timer is not None:
            timer.end(batch)
        return outs

    def _per_sequence(self, batch, tokens: list[int], logprobs: list) -> tuple[list[list[int]], list[list]]:
        """Group the sampled rows by sequence (a drafted one has a row per draft, plus one) and resolve drafts."""
        out_tokens, out_logprobs, i = [], [], 0
        for s in batch:
            if not s.samples:
                continue
            rows = 1 + s.seq.num_draft_tokens
            if rows == 1:
                out_tokens.append([tokens[i]])
                out_logprobs.append([logprobs[i]])
            else:
                new = self.speculator.resolve(s, tokens[i : i + rows])
                out_tokens.append(new)
                out_logprobs.append([None] * len(new))
            i += rows
        return out_tokens, out_logprobs

    def _process_tokens(self, seq: Sequence, tokens: list[int], logprobs: list) -> RequestOutput:
        """Detokenize the step's new tokens (the last ``len(tokens)`` of the sequence) and stop at the first
        that ends the request; tokens after it are dropped."""
        req = self.requests[seq.request_id]
        now = time.monotonic()
        req.metrics.first_token_time = req.metrics.first_token_time or now
        req.metrics.last_token_time = now
        first = len(seq) - len(tokens)
        for j, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            if lp is not None:
                req.logprobs.append(lp)
            reason, stop_reason = self._check_stop(seq, req, token, length=first + j + 1)
            if reason is not None:
                del seq.token_ids[first + j + 1 :]
                self.scheduler.finish(seq, reason, stop_reason)
                break
        return self._output(req)

    def _check_stop(self, seq: Sequence, req: _Request, token: int, length: int):
        """(finish reason, stop reason) after ``token``, the sequence's ``length``-th token, or (None, None)."""
        params = seq.sampling_params
        n_out = length - seq.num_prompt_tokens
        req.text += req.detokenizer.push([token])
        reason, stop_reason = None, None
        if seq.grammar is not None and (not seq.grammar.consume_token(token) or seq.grammar.is_error()):
            # The grammar hit one of llguidance's limits (its mask then allows only EOS: the output would end
            # as "stop", cut mid-document), or the mask let a token through that it should not have (a bug):
            # either way the client is told why.
            error = (seq.grammar.get_error() or "the token was not allowed").splitlines()[0]
            log.warning("request %s: token %d broke its grammar: %s", seq.request_id, token, error)
            req.error = f"the grammar engine (llguidance) stopped this request: {error}"
            return FinishReason.ABORT, None
        if n_out >= params.min_tokens:
            if token in self.tokenizer.eos_token_ids and not params.ignore_eos:
                reason = FinishReason.STOP
            elif token in params.stop_token_ids:
                reason, stop_reason = FinishReason.STOP, token
            elif req.stops is not None:
                req.text, matched = req.stops.check(req.text, len(req.text) - req.emitted_text)
                if matched is not None:
                    reason, stop_reason = FinishReason.STOP, matched
        if reason is None and seq.grammar is not None and seq.grammar.is_stopped():  # nothing more may follow
            reason = FinishReason.STOP
        if reason is None and (params.max_tokens is not None and n_out >= params.max_tokens
                               or length >= self.max_model_len):
            reason = FinishReason.LENGTH
        return reason, stop_reason

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        finished = seq.is_finished
        if finished:
            if seq.stop_reason is None:
                req.text += req.detokenizer.flush()
            self.requests.pop(seq.request_id, None)
            req.metrics.finished_time = time.monotonic()
            if self.speculator is not None:
                self.speculator.proposer.forget(seq)
        # Hold back text that could still turn out to start a stop string.
        end = len(req.text) if finished or req.stops is None else req.stops.safe_text_end(req.text)
        end = max(end, req.emitted_text)
        new_text = req.text[req.emitted_text : end]
        req.emitted_text = end
        out_ids = seq.output_token_ids
        new_ids = out_ids[req.emitted_tokens :]
        new_logprobs = req.logprobs[req.emitted_tokens :] if seq.sampling_params.logprobs is not None else None
        req.emitted_tokens = len(out_ids)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, token_ids=out_ids, text=req.text,
            new_token_ids=new_ids, new_text=new_text, finished=finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None, stop_reason=seq.stop_reason,
            num_cached_tokens=seq.num_cached_tokens, metrics=req.metrics,
            logprobs=req.logprobs if seq.sampling_params.logprobs is not None else None, new_logprobs=new_logprobs,
            prompt_logprobs=req.prompt_logprobs if seq.sampling_params.prompt_logprobs is not None else None,
            error=req.error)


class LLM:
    """Offline generation: ``LLM("smollm2").generate(["Hello"], SamplingParams(max_tokens=32))``."""

    def __init__(self, model: str, progress: bool = True, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), progress=progress)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (they also end with this process)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]

    def chat(self, conversations: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.encode_chat(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
