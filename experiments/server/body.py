"""Reading a request's body for the routes (experiments.server.routes): its bytes, its JSON, its counts and sizes
checked before any element is validated, rendered or tokenised.

What one request may cost before it is refused or queued. Its body is at most the app's byte limit (16 MiB unless
told) and arrives within the connection's body deadline (experiments.server.cli.BODY_TIMEOUT, 30 s). It is parsed
as JSON once, with the garbage collector paused (`parse`, on a worker thread, as is everything after it); then its
counts and sizes are checked (`Limits`) before any element of it is validated, rendered or tokenised:

  prompts x n        at most --max-waiting (the most sequences the server ever queues at once)
  token-id prompt    fewer ids than the server's limit L = min(max_model_len, KV pool) tokens (prompt and output)
  text prompt        at most 2 (L - 1) b characters, b the most characters one token reads (the longest token's
                     bytes, or a special token's name): no longer text tokenises to L - 1 tokens or fewer (a
                     character is at least one byte, or two thirds of one once NFC normalisation composed it)
  messages           fewer than L (a chat template renders each message as one token at least: its role's marker)

and a string anywhere in the body (keys too) holding a lone surrogate, valid JSON but no Unicode text, is refused.
So the validation, the chat template's rendering and the tokenisation that follow (experiments.server.serving, also
on worker threads) touch at most --max-waiting prompts or L - 1 messages, within the body's bytes. Each refusal is
one 400 naming the field (`param`), its value and what is allowed. The event loop (/health, running streams) waits
only while a worker holds the GIL in C code: the JSON parse (linear in the body: 0.6 s for 16 MiB of 4M one-element
lists, the costliest JSON per byte, on a busy 2-core AMD EPYC; docs/serving.md has the measurements) or one C call
of a tokenizer on one text of the sizes above. A smaller --max-body-mib shortens that wait in proportion.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import re
import threading
from typing import Any, TypeVar

import pydantic
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from starlette.requests import ClientDisconnect

from experiments.server.protocol import MAX_N, ChatCompletionRequest, CompletionRequest
from experiments.server.serving import ApiError, OpenAIServing, too_many_sequences

__all__ = ["Limits", "parse", "read_body"]

Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)


async def read_body(raw: HTTPRequest, model: type[Body], s: OpenAIServing) -> Body:
    """`raw`'s body as `model`: read on the event loop (the app's byte limit and the connection's deadline apply),
    then parsed and checked against `s`'s limits on a worker thread (`parse`). Raises ApiError 415 for a
    Content-Type other than JSON's (none at all is read as JSON), else what `parse` raises."""
    try:
        data = await raw.body()
    except ClientDisconnect:  # the client left, or its body's deadline passed: nobody reads this
        raise ApiError(499, "the client closed the connection before its body arrived") from None
    kind = raw.headers.get("content-type")
    if kind is not None and not _is_json(kind):
        raise ApiError(415, f"the body must be JSON (Content-Type: application/json); got Content-Type: {kind}")
    return await asyncio.to_thread(parse, data, model, Limits.of(s))


def parse(data: bytes, model: type[Body], limits: Limits) -> Body:
    """`data` (a JSON body) as `model`, checked in the module docstring's order: JSON (ApiError 400 "malformed JSON
    body"), `limits` (ApiError 400 naming the field), lone surrogates (ApiError 400 naming where), then the model
    (RequestValidationError, the app's 400 naming the first field at fault). Cost: linear in `data`'s length."""
    with _GC_PAUSE:
        try:
            value = json.loads(data)
        except ValueError as e:  # JSONDecodeError, or bytes that are no UTF-8
            raise ApiError(400, f"malformed JSON body: {e}") from None
    if isinstance(value, dict):
        limits.check(value, model)
        if _ESCAPED_SURROGATE.search(data):  # the only way JSON spells one: most bodies skip the walk
            _check_unicode(value)
    try:
        return model.model_validate(value)
    except pydantic.ValidationError as e:
        errors = [_in_body(detail) for detail in e.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def _in_body(error: Any) -> dict[str, Any]:
    """A pydantic error located in the request body, as FastAPI locates those it finds itself ("body", ...)."""
    return {**error, "loc": ("body", *error["loc"])}


@dataclasses.dataclass(frozen=True)
class Limits:
    """The counts and sizes a body may have (module docstring), checked on its parsed JSON before any element is
    validated: `sequences` prompts x n (--max-waiting), `tokens` = L for a prompt and its output, `text_chars`
    characters of a text prompt; `allowed` what a prompt may hold and where L comes from (OpenAIServing.allowed)."""

    sequences: int
    tokens: int
    text_chars: int
    allowed: str

    @classmethod
    def of(cls, s: OpenAIServing) -> Limits:
        """`s`'s limits, as they are now (--max-waiting may change while it serves)."""
        tok = s.tokenizer  # the most characters one token reads: its bytes, or a special token's name
        longest = max(int(tok.byte_lengths.max()), max(map(len, tok.special_tokens), default=0), 1)
        return cls(s.runner.max_waiting, s.limit, 2 * (s.limit - 1) * longest, s.allowed())

    def check(self, body: dict[str, Any], model: type[Body]) -> None:
        """Raises ApiError 400 naming the field if `body` (the parsed JSON of a `model`) exceeds a limit. Reads only
        lengths (and the first element of a prompt list): O(prompts) at most, whatever the body holds."""
        if model is ChatCompletionRequest:
            messages = body.get("messages")
            if isinstance(messages, list) and len(messages) >= self.tokens:
                raise ApiError(
                    400,
                    f"messages holds {len(messages):,} messages; a chat template renders each as one token at least "
                    f"and {self.allowed}, so at most {self.tokens - 1} messages",
                    param="messages",
                )
            return
        prompt: Any = body.get("prompt")
        n = body.get("n", 1)
        n = n if type(n) is int and 1 <= n <= MAX_N else 1  # a bad n is the model's to refuse
        several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
        prompts: list[Any] = prompt if several else [prompt]
        if len(prompts) * n > self.sequences:  # can never be queued at once: refused before anything is read
            raise too_many_sequences(len(prompts), n, self.sequences, "prompt")
        for i, p in enumerate(prompts):
            which = f"prompt {i}" if several else "the prompt"
            if isinstance(p, list) and len(p) >= self.tokens:
                raise ApiError(400, f"{which} has {len(p):,} token ids; {self.allowed}", param="prompt")
            if isinstance(p, str) and len(p) > self.text_chars:
                raise ApiError(
                    400,
                    f"{which} has {len(p):,} characters; {self.allowed}, and no text of more than "
                    f"{self.text_chars:,} characters tokenises that short with this tokenizer",
                    param="prompt",
                )


def _is_json(content_type: str) -> bool:
    """Whether a Content-Type is JSON's: application/json or application/*+json (parameters ignored)."""
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_unicode(body: dict[str, Any]) -> None:
    """Raises ApiError 400 naming the first string of `body` (key or value, in document order) that holds a lone
    surrogate ("\\ud800" is valid JSON, and json.loads makes it a str, but it has no UTF-8 form: no tokenizer,
    template or response can carry it). `param` is its path (`messages.0.name`), a bad key shown JSON-escaped."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if bad := _SURROGATE.search(value):
                raise ApiError(
                    400,
                    f"{path} = {_shown(value)}: character {bad.start()} is a lone surrogate (U+{ord(bad.group()):04X}),"
                    " valid JSON but no Unicode text; only text is allowed",
                    param=path,
                )
        elif isinstance(value, dict):
            for key in value:
                if bad := _SURROGATE.search(key):
                    where = f"{path}.{json.dumps(key)[1:-1]}" if path else json.dumps(key)[1:-1]
                    raise ApiError(
                        400,
                        f"the field name {json.dumps(key)} (at {path or 'the top level'}) holds a lone surrogate "
                        f"(U+{ord(bad.group()):04X}), valid JSON but no Unicode text; only text is allowed",
                        param=where,
                    )
            stack += [(f"{path}.{k}" if path else k, v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            inner = [(f"{path}.{i}", v) for i, v in enumerate(value) if isinstance(v, str | list | dict)]
            stack += reversed(inner)


def _shown(value: str) -> str:
    """`value` as ASCII JSON, cut to 40 characters."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _GCPause:
    """The cyclic garbage collector off while any thread is inside (overlapping users share one pause; it is turned
    back on when the last leaves, if it was on before the first came). Parsing JSON allocates millions of containers
    and no cycles, and each collection this triggers walks them all: 2M one-element lists parse in 1.4 s with it on,
    0.26 s off."""

    def __init__(self) -> None:
        self._lock, self._inside, self._resume = threading.Lock(), 0, False

    def __enter__(self) -> None:
        with self._lock:
            if self._inside == 0:
                self._resume = gc.isenabled()
                gc.disable()
            self._inside += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._inside -= 1
            if self._inside == 0 and self._resume:
                gc.enable()


_GC_PAUSE = _GCPause()
