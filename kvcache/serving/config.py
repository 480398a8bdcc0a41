"""What a serving engine is configured with (`EngineConfig`) and how one request samples (`SamplingParams`).

Both refuse bad values at construction with a ValueError naming the field, the value and what is allowed. The
special ids come from the tokenizer the model was trained with (`EngineConfig.for_tokenizer`): nothing defaults to
a particular tokenizer's ids. A request ends, as vLLM ends it, at the tokenizer's EOS or at any end id of the model's
generation config (`EngineConfig.eos_ids`) unless it ignores EOS, and at any of its own `stop_token_ids` always.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from core.sampling import MAX_TOP_LOGPROBS
from kvcache import attention

if TYPE_CHECKING:
    from core.tokenizer import Tokenizer

__all__ = ["MAX_TOP_LOGPROBS", "EngineConfig", "SamplingParams"]

_SEED_BOUND = 2**64  # seeds are two 32-bit words of a PRNG key (core.sampling.key_words)
_MISSING: Any = object()  # a special id not given: refused in __post_init__


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """memory_bytes: KV pool size; block_size: tokens per pool block; max_num_seqs / max_num_batched_tokens:
    per-step limits; max_model_len: the longest sequence (prompt + output) a request may reach (>= 2 x
    max_num_batched_tokens: a step's padded batch is addressed like one sequence); implementation: the attention
    implementation (`kvcache.attention.IMPLEMENTATIONS`, one that runs mixed prefill and decode batches);
    temperature: the default of requests that set none (0 = greedy); seed: the engine's stream for requests without
    a seed of their own, in [0, 2^64); decode_steps: K >= 1, decode steps per device call when every scheduled
    sequence decodes and no request waits (`kvcache.serving.engine`: the same tokens as K single steps; 1 = a call
    per step).

    The tokenizer's ids, required (`EngineConfig.for_tokenizer(tok, ...)` reads them): `eos_id` ends a request
    (None: only max_new_tokens does); the ids in `never` and those >= `num_ids` (None: no limit) are never sampled.
    A config without them is refused. `eos_ids`: the model's other end ids (generation_config.json's
    `eos_token_id` list, e.g. `<|im_end|>`, `<|eot_id|>`), which end a request as `eos_id` does; none may be in
    `never` or >= num_ids.
    """

    memory_bytes: int
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 4096
    implementation: str = "xla"
    temperature: float = 0.0
    seed: int = 0
    decode_steps: int = 8
    eos_id: int | None = cast(int, _MISSING)
    never: tuple[int, ...] = cast(tuple, _MISSING)
    num_ids: int | None = cast(int, _MISSING)
    eos_ids: tuple[int, ...] = ()

    @classmethod
    def for_tokenizer(cls, tok: Tokenizer, *, eos_ids: Sequence[int] = (), **kwargs) -> EngineConfig:
        """The config of `kwargs` with `tok`'s ids: eos_id = tok.eos_id, never = tok.never_sampled less the end
        ids, num_ids = tok.vocab_size (`core.tokenizer.Tokenizer`), and `eos_ids` (a generation config's end ids;
        the tokenizer's EOS among them is left out: it is eos_id)."""
        ends = tuple(dict.fromkeys(int(i) for i in eos_ids if i != tok.eos_id))
        never = tuple(i for i in tok.never_sampled if i not in ends)
        return cls(**{**kwargs, **dict(eos_id=tok.eos_id, never=never, num_ids=tok.vocab_size, eos_ids=ends)})

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Every id that ends a request that does not ignore EOS: eos_id (if any), then eos_ids."""
        return tuple(dict.fromkeys([*(() if self.eos_id is None else (self.eos_id,)), *self.eos_ids]))

    def __post_init__(self):
        missing = [name for name in ("eos_id", "never", "num_ids") if getattr(self, name) is _MISSING]
        if missing:
            raise ValueError(
                f"EngineConfig needs the tokenizer's special ids; missing {missing}: pass eos_id=tok.eos_id, "
                "never=tok.never_sampled, num_ids=tok.vocab_size (or build it with EngineConfig.for_tokenizer(tok, "
                "...)); None for eos_id / num_ids means no end id / no limit"
            )
        for name in (
            "memory_bytes",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "decode_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} = {getattr(self, name)}; must be >= 1")
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"EngineConfig.temperature = {self.temperature}; must be >= 0")
        if not _is_int(self.seed) or not 0 <= self.seed < _SEED_BOUND:
            raise ValueError(f"EngineConfig.seed = {self.seed!r}; must be an integer in [0, 2**64)")
        attention.check_implementation(self.implementation)
        for name in ("eos_id", "num_ids"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"EngineConfig.{name} = {value!r}; must be an integer >= 0 or None")
        bad = [t for t in self.never if not _is_int(t) or t < 0]
        if bad:
            raise ValueError(f"EngineConfig.never holds {bad[0]!r}; every id must be an integer >= 0")
        if self.eos_id is not None and (
            self.eos_id in self.never or (self.num_ids is not None and self.eos_id >= self.num_ids)
        ):
            raise ValueError(
                f"EngineConfig.eos_id = {self.eos_id} can never be sampled (it is in `never` or >= num_ids = "
                f"{self.num_ids}); the end id must be sampleable"
            )
        if not isinstance(self.eos_ids, tuple):
            raise ValueError(f"EngineConfig.eos_ids = {self.eos_ids!r}; must be a tuple of ids")
        for i in self.eos_ids:
            if not _is_int(i) or i < 0 or i in self.never or (self.num_ids is not None and i >= self.num_ids):
                raise ValueError(
                    f"EngineConfig.eos_ids holds {i!r}; every end id must be an integer >= 0 that can be sampled (not "
                    f"in `never`, below num_ids = {self.num_ids})"
                )
        if self.max_model_len < 2 * self.max_num_batched_tokens:
            raise ValueError(
                f"EngineConfig.max_model_len = {self.max_model_len} must be >= 2 x "
                f"max_num_batched_tokens = {2 * self.max_num_batched_tokens} (a step's padded batch "
                "is addressed like one sequence)"
            )
        if attention.IMPLEMENTATIONS[self.implementation].unified is None:
            raise ValueError(
                f"EngineConfig.implementation = {self.implementation!r} runs decode only; the engine's batches mix "
                f"prefill and decode: use one of {[n for n, i in attention.IMPLEMENTATIONS.items() if i.unified]}"
            )


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples its tokens (`core.sampling.sample` on the device; OpenAI's parameters of the same
    names).

    temperature: None = the engine's `EngineConfig.temperature`; 0 = greedy (argmax), else softmax(logits / T).
    top_k: keep the k most likely ids (0 = all); top_p: then the smallest set of the most likely ids whose
    probability (after temperature and top_k) reaches top_p (1 = all). seed: the request's own random stream, in
    [0, 2^64): token i is drawn with the key of (seed, i) (`core.sampling.key_words`), so the same seed gives the
    same tokens whatever else the engine serves; None = the engine's stream. logprobs: record each chosen token's
    log-probability and the `top_logprobs` (<= MAX_TOP_LOGPROBS) most likely ids with theirs, all under the
    model's distribution over the sampleable ids (log_softmax of the logits, before the penalty, temperature,
    min_p, top_k and top_p, as vLLM reports them).

    vLLM's extensions: min_p (keep the ids at least min_p x as likely as the most likely, after temperature; 0 =
    all); repetition_penalty (> 0; 1 = none): each id of the prompt or the output so far has its logit divided by it
    if positive, multiplied by it if not (transformers' and vLLM's rule; greedy requests too); stop_token_ids: ids
    that end the request (finish_reason "stop") whether or not it ignores EOS; min_tokens: until the request has
    that many tokens, none of its end ids (EOS, the config's eos_ids, its stop_token_ids) is sampled.
    """

    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0

    def __post_init__(self):
        checks = {
            "temperature": self.temperature is None or self.temperature >= 0,  # (NaN fails)
            "top_p": 0 < self.top_p <= 1,
            "top_k": _is_int(self.top_k) and self.top_k >= 0,
            "seed": self.seed is None or (_is_int(self.seed) and 0 <= self.seed < _SEED_BOUND),
            "top_logprobs": _is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            "min_p": 0 <= self.min_p <= 1,
            "repetition_penalty": 0 < self.repetition_penalty < float("inf"),
            "stop_token_ids": isinstance(self.stop_token_ids, tuple)
            and all(_is_int(i) and i >= 0 for i in self.stop_token_ids),
            "min_tokens": _is_int(self.min_tokens) and self.min_tokens >= 0,
        }
        allowed = {
            "temperature": ">= 0 or None",
            "top_p": "in (0, 1]",
            "top_k": "an integer >= 0 (0 = all)",
            "seed": "an integer in [0, 2**64) or None",
            "top_logprobs": f"an integer in [0, {MAX_TOP_LOGPROBS}]",
            "min_p": "in [0, 1]",
            "repetition_penalty": "a finite number > 0 (1 = none)",
            "stop_token_ids": "a tuple of integers >= 0",
            "min_tokens": "an integer >= 0",
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SamplingParams.{name} = {getattr(self, name)!r}; must be {allowed[name]}")
