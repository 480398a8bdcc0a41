"""The OpenAI API's request bodies (as pydantic models) and error body, for the parameters this server honours.

A field the server does not implement is refused, never silently ignored: unknown fields fail validation (extra =
"forbid"), and fields it knows but only in their neutral value (n > 1 is implemented; echo, suffix, best_of > 1,
logit_bias, non-zero presence / frequency penalties are not) fail with a message saying so. Extensions vLLM users
know: `top_k` (0 or -1 = all), `ignore_eos` (generate exactly max_tokens; benchmarks) and `return_token_ids` (each
choice also carries `token_ids`, and a non-streamed one `prompt_token_ids`).

Errors are OpenAI's shape: {"error": {"message", "type", "param", "code"}}; `param` names the field at fault.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvcache.serving import MAX_TOP_LOGPROBS, SamplingParams

__all__ = ["ChatCompletionRequest", "CompletionRequest", "error_body"]

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_N = 16  # completions per prompt


NEUTRAL: dict[
    str, tuple[Any, ...]
] = {  # parameters this server does not implement -> the values that ask for nothing (and are accepted)
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": (None, {}),
    "echo": (False,),
    "suffix": (None, ""),
    "best_of": (None, 1),
}


def _neutral(value, info: ValidationInfo):
    """Refuses a value of an unimplemented parameter other than its neutral ones (NEUTRAL)."""
    allowed = NEUTRAL[info.field_name or ""]
    if value not in allowed:
        shown = " or ".join(json.dumps(a) for a in allowed)
        raise ValueError(f"{info.field_name} is not implemented by this server; allowed: {shown}")
    return value


def _text(value):
    """`value` (a string, or lists of them) if every string is Unicode text; a lone surrogate ("\\ud800", valid
    JSON) has no UTF-8 form, so no tokenizer can read it: ValueError naming its position."""
    for i, s in enumerate([value] if isinstance(value, str) else value if isinstance(value, list) else []):
        if isinstance(s, str):
            bad = next((j for j, ch in enumerate(s) if "\ud800" <= ch <= "\udfff"), None)
            if bad is not None:
                where = f"character {bad}" if isinstance(value, str) else f"string {i}, character {bad}"
                raise ValueError(f"{where} is a lone surrogate (U+{ord(s[bad]):04X}): not Unicode text")
    return value


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no coercion: "10", 2.0, true are not 10
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="forbid", strict=True)  # no coercion: "10", 2.0, true are not 10

    model: str | None = None  # None: the served model
    temperature: Annotated[float, Field(ge=0, le=2)] | None = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] | None = 1.0
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM's extension: -1 / 0 / None = all
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, Field(validate_default=True)] = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id (OpenAI: for abuse monitoring); recorded nowhere
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM's extension: each choice also carries its token ids (and the prompt's)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"at most {MAX_STOP} non-empty stop strings")
        return _text(stops)

    _unimplemented = field_validator("presence_penalty", "frequency_penalty", "logit_bias")(_neutral)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_with_stream(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return value

    def sampling(self, *, seed_offset: int = 0, logprobs: int | None = None) -> SamplingParams:
        """The engine's SamplingParams for completion `seed_offset` of a prompt (seed + offset: n completions of
        one seeded request differ and repeat); `logprobs`: alternatives per token to report (None: no logprobs)."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=None if self.seed is None else (self.seed + seed_offset) % 2**63,
            logprobs=logprobs is not None,
            top_logprobs=logprobs or 0,
        )


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    _unimplemented_here = field_validator("echo", "suffix", "best_of")(_neutral)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("a prompt must not be empty")
        return _text(value)

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string, several strings, one list of ids or several."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no coercion: "10", 2.0, true are not 10
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _unicode(cls, value):
        return _text(value)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no coercion: "10", 2.0, true are not 10
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value):
        return _text(value) if isinstance(value, str) else value

    def as_dict(self) -> dict[str, Any]:
        """The message as templates read it (content parts joined into one string)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's newer name; None: up to the limit
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_with_logprobs(cls, value, info: ValidationInfo):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
