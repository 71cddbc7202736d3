"""A request's JSON body: read within the size limit (Content-Length or chunked), parsed off the event loop.

What the JSON parser accepts but nothing after it can use is refused here with a 400: nesting too deep for a
parser (RecursionError) and lone UTF-16 surrogates (``"\\ud800"``: valid JSON, but no character, so neither the
tokenizer nor the response encoder can take it).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request

from kubellm.runtime.server.errors import APIError, bad_request
from kubellm.runtime.server.prompt_workers import PromptWorkers

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def too_large(limit: int, declared: str | None = None) -> APIError:
    size = f"of {declared} bytes " if declared else ""
    # Connection: close, so the server stops taking in the rest of an upload it has refused.
    return APIError(413, f"request body {size}is over the limit of {limit} bytes", code="request_too_large",
                    headers={"Connection": "close"})


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes: a larger one is refused as soon as the bytes read pass the limit,
    so memory never holds more than the limit whatever the client sends."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit, declared)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    return bytes(body)


async def read_json(request: Request, limit: int, workers: PromptWorkers) -> dict[str, Any]:
    """The body as a JSON object (400 for anything else), parsed on a worker."""
    return await workers.run(parse_json_object, await read_body(request, limit))


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8: {e}") from e
    except json.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    except RecursionError as e:
        raise bad_request("request body nests too deeply to parse") from e
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(body) and (path := lone_surrogate_path(data)) is not None:
        where = f"`{path}`" if path else "a key of the request body"
        raise bad_request(f"{where} holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its pair), "
                          "which is not a character; send valid Unicode", path or None)
    return data


def lone_surrogate_path(data: Any) -> str | None:
    """The dotted path of the first string (or object, for a key) in ``data`` with an unpaired surrogate ("" for
    the body itself), else None."""
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:  # not recursive: the parser accepts deeper nesting than Python's recursion limit
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return ".".join(str(p) for p in path)
        elif isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):  # the key itself cannot go into the (UTF-8) error body
                    return ".".join(str(p) for p in path)
                stack.append(((*path, key), item))
        elif isinstance(value, list):
            stack.extend(((*path, i), item) for i, item in enumerate(value))
    return None
