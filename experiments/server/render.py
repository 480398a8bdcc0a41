"""The JSON of the OpenAI API's responses and streamed chunks, one renderer per endpoint: `CompletionRender`
(/v1/completions: `text_completion` objects, logprobs as tokens / token_logprobs / top_logprobs / text_offset) and
`ChatRender` (/v1/chat/completions: `chat.completion` and `chat.completion.chunk`, the first chunk carrying the
assistant's role, logprobs as content entries with each token's bytes).

A renderer is made per HTTP request (its id and creation time are the response's). `usage` counts a prompt's
tokens once however many completions (n) it has, and reports the prompt tokens the prefix cache supplied as
`prompt_tokens_details.cached_tokens`. With `return_token_ids` (vLLM's extension), a choice also carries its
`token_ids`, and a non-streamed one its `prompt_token_ids`. Every choice carries vLLM's `stop_reason` (the stop
string or end id it stopped at; null for EOS, a length or an abort).

A token in logprobs is its text (a special token's name; a token holding part of a UTF-8 character alone: U+FFFD),
or "token_id:N" with `return_tokens_as_token_ids` (vLLM's extension; default the server's flag). The completions
endpoint's `top_logprobs` are OpenAI's {token: logprob} objects: where two of the best tokens have the same text,
each after the first (most likely) is keyed "token_id:N", so every one of the `logprobs` alternatives is there
(vLLM would keep one of them).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from core.tokenizer import StreamDecoder, Tokenizer
from experiments.server.runner import Event, Stream

__all__ = ["ChatRender", "CompletionRender", "Render"]


class Render:
    """The JSON of one endpoint's responses and chunks, for one HTTP request's `body` (its `logprobs` and
    `return_token_ids`). Subclasses set `object` / `chunk_object` (the OpenAI object names) and `prefix` (of the id),
    and implement `chunk` and `response` (and `first_chunk` if their stream opens with one)."""

    object = ""
    chunk_object = ""
    prefix = ""

    def __init__(self, tokenizer: Tokenizer, model: str, body, *, tokens_as_ids: bool = False):
        self.tokenizer, self.model, self.logprobs, self.ids = tokenizer, model, body.logprobs, body.return_token_ids
        as_ids = body.return_tokens_as_token_ids
        self.as_ids = tokens_as_ids if as_ids is None else as_ids
        self.skip = body.skip_special_tokens  # the text's rule (text_offset counts in it)
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())

    def choice(self, index: int, event: Event, stream: Stream | None = None, **fields) -> dict[str, Any]:
        """A choice of a chunk (stream None) or of a response, with the token ids when asked for."""
        out = {"index": index, **fields, "finish_reason": event.finish_reason, "stop_reason": event.stop_reason}
        if self.ids:
            out["token_ids"] = event.token_ids
            if stream is not None:
                out["prompt_token_ids"] = stream.prompt
        return out

    def head(self, object: str) -> dict[str, Any]:
        """The fields every response and chunk of this request begins with: id, object, created, model."""
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}

    def token(self, token_id: int) -> str:
        """One token in logprobs (module docstring): its text, a special's name, or "token_id:N"."""
        if self.as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def usage(self, finals: list[Event], streams: list[Stream]) -> dict[str, Any]:
        """Prompt tokens once per prompt (n completions of one prompt share it), completion tokens of every choice."""
        seen, prompt, cached = set(), 0, 0
        for event, stream in zip(finals, streams):
            if id(stream.prompt) not in seen:
                seen.add(id(stream.prompt))
                prompt, cached = prompt + event.prompt_tokens, cached + event.cached_tokens
        completion = sum(e.completion_tokens for e in finals)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def usage_chunk(self, finals: list[Event], streams: list[Stream]) -> dict[str, Any]:
        """The last chunk of a stream asked for with stream_options.include_usage: no choices, the usage."""
        return {**self.head(self.chunk_object), "choices": [], "usage": self.usage(finals, streams)}

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        """The chunk that opens choice `index`'s stream before any token, or None (no such chunk)."""
        return None

    def chunk(self, index: int, event: Event) -> dict[str, Any]:
        """The chunk carrying choice `index`'s `event`."""
        raise NotImplementedError

    def response(self, finals: list[Event], streams: list[Stream]) -> dict[str, Any]:
        """The non-streamed response: one choice per stream (`finals[i]`: stream i's events merged) and the usage."""
        raise NotImplementedError


class CompletionRender(Render):
    """/v1/completions' `text_completion` objects; logprobs as OpenAI's legacy tokens / token_logprobs /
    top_logprobs / text_offset (the offsets running on across a choice's chunks)."""

    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, tokenizer, model, body, *, tokens_as_ids: bool = False):
        super().__init__(tokenizer, model, body, tokens_as_ids=tokens_as_ids)
        self._offsets: dict[int, tuple[StreamDecoder, int]] = {}  # choice -> (its decoder, characters so far)

    def _logprobs(self, index: int, event: Event) -> dict[str, Any] | None:
        """A token's text_offset is the number of characters of the choice's text complete before it: the tokens
        of one character split over several (bytes of a UTF-8 character) share the offset of that character."""
        if self.logprobs is None:
            return None
        tokens = [self.token(t) for t in event.token_ids]
        decoder, at = self._offsets.get(index) or (StreamDecoder(self.tokenizer, skip_special_tokens=self.skip), 0)
        offsets = []
        for t in event.token_ids:
            offsets.append(at)
            at += len(decoder.feed([t]))
        self._offsets[index] = decoder, at
        top = [self._top(alts) for alts in event.top_logprobs] if self.logprobs else None
        return {"tokens": tokens, "token_logprobs": event.logprobs, "top_logprobs": top, "text_offset": offsets}

    def _top(self, alternatives: list[tuple[int, float]]) -> dict[str, float]:
        """{token: logprob} of the alternatives (best first): a token whose text is already a key is keyed
        "token_id:N" (module docstring), so none is lost."""
        out: dict[str, float] = {}
        for t, lp in alternatives:
            key = self.token(t)
            out[f"token_id:{t}" if key in out else key] = lp
        return out

    def chunk(self, index, event):
        choice = self.choice(index, event, text=event.text, logprobs=self._logprobs(index, event))
        return {**self.head(self.chunk_object), "choices": [choice]}

    def response(self, finals, streams):
        choices = [
            self.choice(i, e, s, text=e.text, logprobs=self._logprobs(i, e))
            for i, (e, s) in enumerate(zip(finals, streams))
        ]
        return {**self.head(self.object), "choices": choices, "usage": self.usage(finals, streams)}


class ChatRender(Render):
    """/v1/chat/completions' `chat.completion` and `chat.completion.chunk` objects; a stream opens with the
    assistant's role; logprobs as content entries (token, logprob, bytes, top_logprobs)."""

    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        """A logprobs content entry: the token, its logprob and its bytes (the token's own bytes: a special's name;
        with return_tokens_as_token_ids, those of "token_id:N", as vLLM gives them)."""
        token = self.token(token_id)
        raw = token.encode() if self.as_ids else self.tokenizer.decode_bytes([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": logprob, "bytes": list(raw)}

    def _logprobs(self, event: Event) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = [
            {**self._entry(t, lp), "top_logprobs": [self._entry(a, alp) for a, alp in alts]}
            for t, lp, alts in zip(event.token_ids, event.logprobs, event.top_logprobs)
        ]
        return {"content": content}

    def first_chunk(self, index):
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        return {**self.head(self.chunk_object), "choices": [{**choice, "finish_reason": None}]}

    def chunk(self, index, event):
        delta = {"content": event.text} if event.text or event.finish_reason is None else {}
        choice = self.choice(index, event, delta=delta, logprobs=self._logprobs(event))
        return {**self.head(self.chunk_object), "choices": [choice]}

    def response(self, finals, streams):
        choices = [
            self.choice(i, e, s, message={"role": "assistant", "content": e.text}, logprobs=self._logprobs(e))
            for i, (e, s) in enumerate(zip(finals, streams))
        ]
        return {**self.head(self.object), "choices": choices, "usage": self.usage(finals, streams)}
