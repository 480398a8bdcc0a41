"""The OpenAI API's request bodies (as pydantic models) and error body, for the parameters this server honours.

A field that would change the answer is never silently ignored: fields the server knows but implements only in their
neutral value (n > 1 is implemented; echo, suffix, best_of > 1, logit_bias, non-zero presence / frequency penalties
are not) fail with a message saying so, and so do the unknown fields of ANSWER_CHANGING (tools, response_format,
vLLM's other extensions, ...) unless null or neutral. Other unknown top-level fields (`metadata`, `store`,
`service_tier`, ...) are ignored with a logged warning, as vLLM does; inside a message or `stream_options` they
are refused.

vLLM's extensions, as vLLM defines them: `top_k` (0 or -1 = all), `min_p`, `repetition_penalty` (> 0; ids of the
prompt and the output so far: positive logits divided by it, negative multiplied), `stop_token_ids` (end the answer,
finish_reason "stop", `stop_reason` the id, whether or not EOS is ignored), `ignore_eos` (the model's end ids,
tokenizer's EOS and generation config's, do not end it), `min_tokens` (no end id is sampled and no stop string ends
the answer before that many tokens), `skip_special_tokens` (false: special tokens' names are in the text),
`include_stop_str_in_output` (the stop string, or the end id's text, stays in the text), `add_special_tokens` (the
tokenizer's BOS / EOS framing around a text prompt: completions default true, chat default false: the chat
template writes its own), `return_token_ids` (each choice also carries `token_ids`, and a non-streamed one
`prompt_token_ids`) and `return_tokens_as_token_ids` (logprobs name every token "token_id:N"; default the server's
--return-tokens-as-token-ids). Sampling fields a request leaves out (temperature, top_p, top_k, min_p,
repetition_penalty) take the model's generation config's values (`--generation-config`), else 1, 1, all, 0, 1; its
max_new_tokens caps max_tokens.

Errors are OpenAI's shape: {"error": {"message", "type", "param", "code"}}; `param` names the field at fault.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvcache.serving import MAX_TOP_LOGPROBS, SamplingParams

__all__ = ["ChatCompletionRequest", "CompletionRequest", "error_body"]

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_N = 16  # completions per prompt
NEUTRAL_SAMPLING: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
"""The value of a sampling field neither the request nor the generation config sets (vLLM's)."""


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


ANSWER_CHANGING: dict[str, tuple[Any, ...]] = {  # unknown fields that change the answer -> their neutral values
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "logits_processors": ([],),
    "bad_words": ([],),
    "allowed_token_ids": ([],),
    "truncate_prompt_tokens": (),
    "prompt_logprobs": (),
    "use_beam_search": (False,),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "modalities": (["text"],),
    "audio": (),
}
"""Null is neutral for each of them too."""

log = logging.getLogger(__name__)


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


PROMPT_KINDS = "a string, a list of strings, a list of token ids (integers) or a list of such lists"


def _shown(value) -> str:
    """`value` as JSON, cut to 40 characters (an error message names a bad element, not a whole body)."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."


def _token_ids(ids: list, where: str) -> None:
    """ValueError naming the first element of `ids` that is not an int (bool and float are not token ids)."""
    bad = next((i for i, t in enumerate(ids) if type(t) is not int), None)
    if bad is not None:
        raise ValueError(f"{where}token {bad} = {_shown(ids[bad])} is not a token id (an integer)")


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no coercion: "10", 2.0, true are not 10
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share; the unknown ones are kept in `model_extra` (module docstring)."""

    model_config = ConfigDict(extra="allow", strict=True)  # no coercion: "10", 2.0, true are not 10

    model: str | None = None  # None: the served model
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # None: the generation config's, else 1
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None  # None: the generation config's, else 1
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM's extension: -1 / 0 = all; None: the generation config's
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None  # vLLM's; None: the generation config's, else 0
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] | None = None  # vLLM's; None: generation config's, else 1
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = None  # vLLM's
    min_tokens: Annotated[int, Field(ge=0)] = 0  # vLLM's
    skip_special_tokens: bool = True  # vLLM's
    include_stop_str_in_output: bool = False  # vLLM's
    return_tokens_as_token_ids: bool | None = None  # vLLM's; None: the server's --return-tokens-as-token-ids
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

    @model_validator(mode="after")
    def _unknown_fields(self):
        """Refuses an unknown field of ANSWER_CHANGING in a value other than null or its neutral ones (the error's
        ctx names it: the app's `param`); logs a warning naming the other unknown fields, which are ignored."""
        extra = self.model_extra or {}
        for name, value in extra.items():
            if name in ANSWER_CHANGING and value is not None and value not in ANSWER_CHANGING[name]:
                allowed = " or ".join(json.dumps(a) for a in (None, *ANSWER_CHANGING[name]))
                raise PydanticCustomError(
                    "not_implemented",
                    "{field} = {value} would change the answer and is not implemented by this server; allowed: "
                    "{allowed}",
                    {"field": name, "value": _shown(value), "allowed": allowed},
                )
        if extra:
            log.warning("ignoring unknown field(s) of the request: %s", ", ".join(sorted(extra)))
        return self

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

    def sampling(
        self, *, seed_offset: int = 0, logprobs: int | None = None, defaults: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        """The engine's SamplingParams for completion `seed_offset` of a prompt (seed + offset: n completions of
        one seeded request differ and repeat); `logprobs`: alternatives per token to report (None: no logprobs);
        `defaults`: the values of the sampling fields the request leaves out (the model's generation config:
        experiments.hf.generation), else vLLM's neutral ones."""
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        value = {k: v if v is not None else (defaults or {}).get(k, NEUTRAL_SAMPLING[k]) for k, v in given.items()}
        return SamplingParams(
            temperature=float(value["temperature"]),
            top_p=float(value["top_p"]),
            top_k=max(int(value["top_k"]), 0),
            min_p=float(value["min_p"]),
            repetition_penalty=float(value["repetition_penalty"]),
            seed=None if self.seed is None else (self.seed + seed_offset) % 2**63,
            logprobs=logprobs is not None,
            top_logprobs=logprobs or 0,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=self.min_tokens,
        )


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    add_special_tokens: bool = True  # vLLM's: the tokenizer's framing (BOS) around a text prompt
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    _unimplemented_here = field_validator("echo", "suffix", "best_of")(_neutral)

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value):
        """The prompt union checked by hand, in time linear in its size and stopping at the first bad element with
        one error naming it (pydantic's union validation reports every element against every branch: a 5M-id list
        with one string in it would cost minutes and gigabytes)."""
        if isinstance(value, str):
            return _text(value)
        if not isinstance(value, list) or not value:
            raise ValueError("a prompt must not be empty" if value == [] else f"expected {PROMPT_KINDS}")
        if isinstance(value[0], str):
            bad = next((i for i, p in enumerate(value) if not isinstance(p, str)), None)
            if bad is not None:
                raise ValueError(f"element {bad} = {_shown(value[bad])} is not a string, as element 0 is")
            return _text(value)
        if isinstance(value[0], list):
            for i, ids in enumerate(value):
                if not isinstance(ids, list) or not ids:
                    raise ValueError(f"element {i} = {_shown(ids)} is not a non-empty list of token ids")
                _token_ids(ids, f"element {i}, ")
            return value
        _token_ids(value, "")
        return value

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
    add_special_tokens: bool = False  # vLLM's: framing around the rendered template too (it writes its own BOS)
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
