"""The OpenAI API routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, and vLLM's
``/tokenize`` and ``/detokenize``; one function per route group.

Every route sits behind the optional API-key check (auth.py). A request is parsed and validated, refused
before anything is queued when it can never run or the server is shedding load, then run as one engine
request per choice; streams interleave the choices as their tokens come.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from kubellm.runtime.engine.llm_engine import RequestOutput
from kubellm.runtime.engine.scheduler import RequestTooLong
from kubellm.runtime.sampling.params import InvalidSamplingParams, SamplingParams
from kubellm.runtime.sampling.structured_output import InvalidGuidedDecoding
from kubellm.runtime.server.async_engine import EngineDead
from kubellm.runtime.server.auth import require_api_key
from kubellm.runtime.server.errors import APIError, bad_request, overloaded
from kubellm.runtime.server.logprobs import chat_logprobs, completion_logprobs
from kubellm.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    UnsupportedField,
    UsageInfo,
    new_id,
    now,
)
from kubellm.runtime.server.request_body import parse_json_object, read_body
from kubellm.runtime.server.state import ServerState
from kubellm.runtime.text.tokenizer import ChatTemplateError
from kubellm.runtime.text.tool_calls import (
    ToolCallingUnavailable,
    ToolCallStream,
    choose_parser,
    cut_calls,
    parse_calls,
    required_grammar,
    template_messages,
)


def openai_router(state: ServerState) -> APIRouter:
    """Every route group of the OpenAI API, behind the optional API-key check."""
    router = APIRouter(dependencies=[Depends(require_api_key(state.options.api_keys))])
    for add_routes in (_model_routes, _completion_routes, _chat_routes, _token_routes):
        add_routes(router, state)
    return router


def _model_routes(router: APIRouter, state: ServerState) -> None:
    @router.get("/v1/models")
    async def models():
        # 503 until ready, so tools that poll /v1/models to wait for a server (as with vLLM) wait long enough.
        if state.phase != "ready":
            raise overloaded(f"the server is not ready ({state.phase})", state.options.retry_after, 503,
                             "not_ready")
        card = {"id": state.options.served_model_name, "object": "model", "created": now(), "owned_by": "kubellm",
                "max_model_len": state.max_model_len}
        return {"object": "list", "data": [card]}


def _completion_routes(router: APIRouter, state: ServerState) -> None:
    @router.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, state, CompletionRequest)
        _check_model(state, req.model)
        _admit(state)
        prompts = await _counted_as_queued(state, _completion_prompts, state, req.prompt)
        jobs = []
        for p_index, ids in enumerate(prompts):
            max_tokens = req.max_tokens if req.max_tokens is not None else state.options.default_completion_max_tokens
            jobs += _jobs(state, req, ids, max_tokens, first_index=p_index * req.n)
        _check_fan_out(state, [len(p) for p in prompts], req.n)
        rid = new_id("cmpl")
        if req.stream:
            return _sse(request, state, _stream_completion(state, req, rid, jobs, prompts))
        outs = await _collect(request, state, jobs, rid)
        return {"id": rid, "object": "text_completion", "created": now(), "model": state.options.served_model_name,
                "choices": _completion_choices(state, req, prompts, outs),
                "usage": _usage(prompts, outs).model_dump(exclude_none=True)}


def _completion_choices(state: ServerState, req: CompletionRequest, prompts: list[list[int]],
                        outs: list[RequestOutput]) -> list[dict]:
    choices = []
    for i, o in enumerate(outs):
        echo = _echo_text(state, req.prompt, prompts, i // req.n) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            ids, entries = _completion_tokens(o, req.echo)
            logprobs, _ = completion_logprobs(state.tokenizer, ids, entries, 0)
        choices.append({"index": i, "text": echo + o.text, "logprobs": logprobs, "finish_reason": o.finish_reason,
                        "stop_reason": o.stop_reason})
    return choices


def _chat_routes(router: APIRouter, state: ServerState) -> None:
    @router.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await _parse(request, state, ChatCompletionRequest)
        _check_model(state, req.model)
        _admit(state)
        parser, overrides, kwargs = _tool_setup(state, req)
        ids = await _counted_as_queued(state, _encode_chat, state, req, kwargs)
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, state.max_model_len - len(ids))
        jobs = _jobs(state, req, ids, max_tokens, first_index=0, **overrides)
        _check_fan_out(state, [len(ids)], req.n)
        rid = new_id("chatcmpl")
        if req.stream:
            return _sse(request, state, _stream_chat(state, req, rid, jobs, len(ids), parser))
        outs = await _collect(request, state, jobs, rid)
        return {"id": rid, "object": "chat.completion", "created": now(), "model": state.options.served_model_name,
                "choices": _chat_choices(state, req, parser, outs),
                "usage": _usage([ids], outs).model_dump(exclude_none=True)}


def _encode_chat(state: ServerState, req: ChatCompletionRequest | TokenizeRequest, extra: dict) -> list[int]:
    """The prompt's token ids through the chat template (a template error is the client's 400); on a worker."""
    _check_prompt_chars(state, sum(len(m.text()) for m in req.messages), "messages")
    try:
        text = state.tokenizer.apply_chat_template(template_messages(req.messages), req.add_generation_prompt,
                                                   **{**(req.chat_template_kwargs or {}), **extra})
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from e
    _check_prompt_chars(state, len(text), "messages")
    # The template writes any BOS it wants itself (as transformers assumes); don't add a second.
    return state.tokenizer.encode(text, add_special_tokens=False)


def _check_prompt_chars(state: ServerState, num_chars: int, param: str) -> None:
    """Refuse, before tokenizing it, a prompt too long to fit the context however it tokenizes."""
    limit = state.options.max_prompt_chars or 2 * state.max_model_len * state.tokenizer.max_chars_per_token
    if num_chars > limit:
        raise bad_request(f"the prompt's {num_chars} characters cannot fit the context of {state.max_model_len} "
                          f"tokens (this server tokenizes at most {limit} characters); shorten it", param,
                          "context_length_exceeded")


def _chat_choices(state: ServerState, req: ChatCompletionRequest, parser, outs: list[RequestOutput]) -> list[dict]:
    choices = []
    for i, o in enumerate(outs):
        message, finish = {"role": "assistant", "content": o.text}, o.finish_reason
        if parser is not None:
            content, calls, _ = parse_calls(parser, o.text)
            if finish == "length":  # a call cut short is still a call; finish_reason says it is cut
                content, calls = cut_calls(parser, o.text)
            if calls:
                calls = calls if req.parallel_tool_calls else calls[:1]
                message = {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}
                finish = finish if finish == "length" else "tool_calls"
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(state.tokenizer, o.token_ids, o.logprobs) if req.logprobs
                        else None, "finish_reason": finish, "stop_reason": o.stop_reason})
    return choices


def _token_routes(router: APIRouter, state: ServerState) -> None:
    # Both answer JSONResponses built on a worker: FastAPI's encoder would walk a long token list on the loop.
    @router.post("/tokenize")
    async def tokenize(request: Request):
        req = await _parse(request, state, TokenizeRequest)
        _check_model(state, req.model)
        _check_loaded(state)
        return JSONResponse(await state.workers.run(_tokenize, state, req))

    @router.post("/detokenize")
    async def detokenize(request: Request):
        req = await _parse(request, state, DetokenizeRequest)
        _check_model(state, req.model)
        _check_loaded(state)
        return JSONResponse(await state.workers.run(_detokenize, state, req))


def _tokenize(state: ServerState, req: TokenizeRequest) -> dict:
    tk = state.tokenizer
    if req.messages is not None:
        tools = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if req.tools else {}
        ids = _encode_chat(state, req, tools)
    else:
        _check_prompt_chars(state, len(req.prompt), "prompt")
        ids = tk.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
            "token_strs": [tk.token_text(t) for t in ids] if req.return_token_strs else None}


def _detokenize(state: ServerState, req: DetokenizeRequest) -> dict:
    vocab = state.engine.vocab_size
    if bad := [t for t in req.tokens if t >= vocab]:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def _check_loaded(state: ServerState) -> None:
    if state.engine is None:
        raise overloaded(f"the server is not ready ({state.phase})", state.options.retry_after, 503, "not_ready")


# ---- request handling helpers --------------------------------------------------------------------
async def _parse(request: Request, state: ServerState, model):
    """The body validated as ``model``: read within the size limit, parsed and validated on a worker."""
    body = await read_body(request, state.options.max_request_bytes)
    return await state.workers.run(_validate, body, model)


def _validate(body: bytes, model):
    data = parse_json_object(body)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, UnsupportedField):
            loc = ".".join(str(p) for p in (*err["loc"], cause.param))
            raise bad_request(str(cause).replace(f"`{cause.param}`", f"`{loc}`"), loc, "unsupported_field") from e
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise bad_request(f"{param}: {msg}" if param else msg, param) from e


def _check_fan_out(state: ServerState, prompt_lengths: list[int], n: int) -> None:
    """Bound what one request may queue: prompts x n sequences, and their prompt tokens to what the server
    queues before it sheds load (each max_tokens is bounded by the context)."""
    cap, sequences = state.options.max_sequences_per_request, len(prompt_lengths) * n
    if sequences > cap:
        raise bad_request(f"this request asks for {len(prompt_lengths)} prompt(s) x n={n} = {sequences} sequences; "
                          f"at most {cap} per request", "n")
    tokens, budget = sum(prompt_lengths) * n, int(state.options.kv_admit_factor * state.engine.capacity_tokens)
    if tokens > budget:
        raise bad_request(f"this request's sequences hold {tokens} prompt tokens; this server queues at most "
                          f"{budget} at once: split it into smaller requests", "prompt" if len(prompt_lengths) > 1
                          else "n")


def _check_model(state: ServerState, name: str | None) -> None:
    if name and name != state.options.served_model_name:
        raise APIError(404, f"The model `{name}` does not exist; this server serves "
                            f"`{state.options.served_model_name}`.", "not_found_error", "model", "model_not_found")


def _admit(state: ServerState) -> None:
    """Shed load before any work is queued: 503 while not serving, 429 when the queue is full."""
    opts = state.options
    if state.phase == "draining":
        state.metrics.rejected("draining")
        raise overloaded("the server is draining for shutdown; retry on another replica", opts.retry_after, 503,
                         "draining")
    if state.phase != "ready":
        raise overloaded(f"the server is not ready ({state.phase})", opts.retry_after, 503, "not_ready")
    engine = state.engine
    queued = engine.num_queued + state.admitting
    if queued >= opts.max_queue:
        state.metrics.rejected("queue_full")
        raise overloaded(f"{queued} requests are already queued (max {opts.max_queue}); retry later",
                         opts.retry_after, 429, "queue_full")
    if engine.waiting_prompt_tokens > opts.kv_admit_factor * engine.capacity_tokens:
        state.metrics.rejected("kv_cache_full")
        raise overloaded("the KV cache cannot take more queued work now; retry later", opts.retry_after, 429,
                         "kv_cache_full")


async def _counted_as_queued(state: ServerState, fn, *args):
    """``fn(*args)`` on a worker (an admitted request's tokenization), counted as queued meanwhile: a burst must
    not all pass :func:`_admit` before any of it reaches the engine's queue."""
    state.admitting += 1
    try:
        return await state.workers.run(fn, *args)
    finally:
        state.admitting -= 1


def _completion_prompts(state: ServerState, prompt) -> list[list[int]]:
    """Each prompt's token ids (strings tokenized); on a worker."""
    if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = prompt
    out = []
    for p in prompts:
        if isinstance(p, str):
            _check_prompt_chars(state, len(p), "prompt")
        ids = state.tokenizer.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        out.append(ids)
    return out


def _tool_setup(state: ServerState, req: ChatCompletionRequest) -> tuple[str | None, dict, dict]:
    """(tool-call parser or None, sampling-param overrides, chat-template kwargs) for the request's tools."""
    mode = req.tool_mode
    if mode == "none":
        return None, {}, {}
    try:
        parser = choose_parser(state.options.tool_call_parser, state.tokenizer.chat_template,
                               constrained=mode in ("required", "named"))
    except ToolCallingUnavailable as e:
        raise bad_request(str(e), "tools", "tools_unsupported") from e
    overrides: dict = {"skip_special_tokens": False} if parser == "mistral" else {}  # [TOOL_CALLS] is special
    if mode in ("required", "named"):
        if req.sampling_params(1, 1).guided is not None:
            raise bad_request("tool_choice required or a named function already constrains the output; drop "
                              "response_format / structured_outputs", "tool_choice")
        overrides["guided"] = required_grammar(req.called_tools(), parser,
                                               req.parallel_tool_calls and mode == "required")
    return parser, overrides, {"tools": [t.model_dump(exclude_none=True) for t in req.tools]}


def _jobs(state: ServerState, req, ids: list[int], max_tokens: int, first_index: int, **overrides) -> list[tuple]:
    """(choice index, prompt ids, sampling params) per choice; n choices get seeds seed, seed+1, ..."""
    try:
        base = req.sampling_params(max_tokens, state.options.default_completion_max_tokens)
        base = replace(base, **overrides) if overrides else base
        state.engine.validate(ids, base)  # refuse before queueing, so streams never start doomed
    except (InvalidSamplingParams, InvalidGuidedDecoding) as e:
        raise bad_request(str(e), e.param) from e
    except ValueError as e:
        raise _to_api_error(e) from e
    seed = base.seed
    return [(first_index + i, ids, base if i == 0 or seed is None else replace(base, seed=seed + i))
            for i in range(req.n)]


def _to_api_error(e: Exception) -> APIError:
    if isinstance(e, RequestTooLong):
        return bad_request(str(e), "messages" if "prompt" in str(e) else "max_tokens", "context_length_exceeded")
    if isinstance(e, EngineDead):
        return APIError(503, str(e), "service_unavailable", code="engine_failed", headers={"Retry-After": "1"})
    if isinstance(e, ValueError):
        return bad_request(str(e))
    return APIError(500, f"internal error: {e}", "internal_error")


async def _run_one(state: ServerState, rid: str, ids: list[int], params: SamplingParams) -> AsyncIterator:
    try:
        async for out in state.engine.generate(ids, params, rid):
            if out.error is not None:  # e.g. the grammar hit llguidance's limits: a bare "abort" says nothing
                raise bad_request(out.error, params.guided.param if params.guided else None, "grammar_error")
            yield out
    except APIError:
        raise
    except Exception as e:
        raise _to_api_error(e) from e


async def _collect(request: Request, state: ServerState, jobs: list[tuple], rid: str) -> list[RequestOutput]:
    """Run every choice to completion; abort them all if the client goes away first."""

    async def one(index, ids, params):
        last = None
        async for out in _run_one(state, f"{rid}-{index}", ids, params):
            last = out
        return last

    state.active_requests += 1
    choices = [asyncio.ensure_future(one(*job)) for job in jobs]
    work = asyncio.gather(*choices)
    # A client leaving is a normal end, not an error: take the gather's CancelledError so asyncio does not
    # log it as lost.
    work.add_done_callback(lambda f: f.cancelled() or f.exception())
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            raise APIError(499, "client disconnected", "client_closed_request")
        return work.result()
    finally:
        disconnect.cancel()
        for choice in choices:  # the client left or one choice failed: cancelling the rest aborts them
            choice.cancel()
        state.active_requests -= 1


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _usage(prompts: list[list[int]], outs: list[RequestOutput]) -> UsageInfo:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(o.token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs[: len(prompts)])
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                     total_tokens=prompt_tokens + completion,
                     prompt_tokens_details={"cached_tokens": cached} if cached else None)


def _choice_usage(num_prompt: int, out: RequestOutput | None) -> dict:
    """One choice's usage so far (``stream_options.continuous_usage_stats``: in every chunk, as vLLM sends it)."""
    completion = len(out.token_ids) if out is not None else 0
    return {"prompt_tokens": num_prompt, "completion_tokens": completion, "total_tokens": num_prompt + completion}


# ---- streaming -----------------------------------------------------------------------------------
# JSON leaves U+0085, U+2028 and U+2029 raw, and clients that split the stream with str.splitlines (httpx's
# iter_lines, many hand-written ones) cut an event there; escaped, every event stays on its one line.
_UNICODE_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(chunk: dict) -> str:
    """One server-sent event carrying ``chunk`` as JSON (UTF-8, no raw line breaks of any kind)."""
    return f"data: {json.dumps(chunk, ensure_ascii=False).translate(_UNICODE_LINE_BREAKS)}\n\n"


def _sse(request: Request, state: ServerState, chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        state.active_requests += 1
        try:
            async for chunk in chunks:
                yield sse_event(chunk)
            yield "data: [DONE]\n\n"
        finally:
            state.active_requests -= 1

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _merge(state: ServerState, rid: str, jobs: list[tuple]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the outputs of every choice as they come; cancelling this cancels (aborts) them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, ids, params):
        try:
            async for out in _run_one(state, f"{rid}-{index}", ids, params):
                await queue.put((index, out))
        except Exception as e:
            await queue.put((index, e))

    tasks = [asyncio.ensure_future(pump(*job)) for job in jobs]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item.finished:
                remaining -= 1
            yield index, item
    finally:
        for t in tasks:
            t.cancel()


async def _stream_completion(state, req: CompletionRequest, rid: str, jobs, prompts) -> AsyncIterator[dict]:
    created, model = now(), state.options.served_model_name
    merged = _merge(state, rid, jobs)
    usage_prompts, outs, offsets = {}, {}, {}

    def chunk(index, text, logprobs=None, out=None):
        body = {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": index, "text": text, "logprobs": logprobs,
                             "finish_reason": out.finish_reason if out and out.finished else None,
                             "stop_reason": out.stop_reason if out and out.finished else None}]}
        if req.continuous_usage:
            body["usage"] = _choice_usage(len(prompts[index // req.n]), outs.get(index))
        return body

    try:
        async for index, out in _with_errors(merged):
            if isinstance(out, dict):
                yield out
                return
            usage_prompts[index // req.n] = out.prompt_token_ids
            if index not in outs and req.echo:  # the prompt first, with its logprobs
                echo = _echo_text(state, req.prompt, prompts, index // req.n)
                lp = None
                if req.logprobs is not None:
                    ids, entries = _completion_tokens(out, echo=True, output=False)
                    lp, offsets[index] = completion_logprobs(state.tokenizer, ids, entries, 0)
                offsets.setdefault(index, len(echo))
                yield chunk(index, echo, lp)
            outs[index] = out
            lp = None
            if req.logprobs is not None and out.new_token_ids:
                lp, offsets[index] = completion_logprobs(state.tokenizer, out.new_token_ids, out.new_logprobs,
                                                         offsets.get(index, 0))
            if out.new_text or out.finished or lp:
                yield chunk(index, out.new_text, lp, out)
        if req.include_usage:
            yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": _usage(list(usage_prompts.values()), list(outs.values())).model_dump(exclude_none=True)}
    finally:
        await merged.aclose()


def _echo_text(state: ServerState, prompt, prompts: list[list[int]], p_index: int) -> str:
    """The prompt as the client sent it (decoded when it was token ids)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and isinstance(prompt[p_index], str):
        return prompt[p_index]
    return state.tokenizer.decode(prompts[p_index])


def _completion_tokens(out: RequestOutput, echo: bool, output: bool = True) -> tuple[list[int], list]:
    """Token ids and their logprob entries for a completion choice: the prompt's first under ``echo``
    (None for its first token, which nothing predicts), then the output's."""
    ids, entries = [], []
    if echo:
        ids += out.prompt_token_ids
        entries += [None, *(out.prompt_logprobs or [None] * len(out.prompt_token_ids))[1:]]
    if output:
        ids += out.token_ids
        entries += out.logprobs or []
    return ids, entries


async def _stream_chat(state, req: ChatCompletionRequest, rid: str, jobs, num_prompt: int,
                       parser: str | None) -> AsyncIterator[dict]:
    created, model = now(), state.options.served_model_name

    started, outs, calls = set(), {}, {}

    def chunk(index, delta, finish=None, stop_reason=None, logprobs=None):
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                             **({"stop_reason": stop_reason} if finish else {})}]}
        if req.continuous_usage:
            body["usage"] = _choice_usage(num_prompt, outs.get(index))
        return body

    merged = _merge(state, rid, jobs)
    try:
        async for index, out in _with_errors(merged):
            if isinstance(out, dict):
                yield out
                return
            if index not in started:
                started.add(index)
                yield chunk(index, {"role": "assistant", "content": ""})
                if parser is not None:
                    calls[index] = ToolCallStream(parser)
            outs[index] = out
            lp = None
            if req.logprobs and out.new_token_ids:
                lp = chat_logprobs(state.tokenizer, out.new_token_ids, out.new_logprobs)
            if parser is None:
                deltas = [{"content": out.new_text}] if out.new_text else []
            else:
                if out.finish_reason == "length":
                    deltas = calls[index].cut(out.new_text)
                else:
                    deltas = calls[index].feed(out.new_text, final=out.finished)
                if not req.parallel_tool_calls:
                    deltas = [d for d in deltas if d.get("tool_calls", [{}])[0].get("index", 0) == 0]
            for j, delta in enumerate(deltas or ([{}] if lp else [])):
                yield chunk(index, delta, logprobs=lp if j == 0 else None)
            if out.finished:
                called = parser is not None and calls[index].called and out.finish_reason != "length"
                finish = "tool_calls" if called else out.finish_reason
                yield chunk(index, {}, finish, out.stop_reason)
        if req.include_usage:
            yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                   "usage": _usage([[0] * num_prompt], list(outs.values())).model_dump(exclude_none=True)}
    finally:
        await merged.aclose()


async def _with_errors(merged: AsyncIterator) -> AsyncIterator[tuple]:
    """Turn an error mid-stream into one OpenAI error event (the HTTP status is already sent)."""
    try:
        async for item in merged:
            yield item
    except APIError as e:
        yield -1, {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


