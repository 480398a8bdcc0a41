"""What serving a run reads besides its weights: the tokenizer, framing prompts as the model was trained to read
them, and the generation config (the model's end ids and its recommended sampling parameters), as transformers and
vLLM read a checkpoint.

    tok = generation.run_tokenizer(config)                    # core.tokenizer, with the run's prompt framing
    gen = generation.for_run(config, "auto")                  # GenerationConfig: eos_ids, defaults, source
    EngineConfig.for_tokenizer(tok, eos_ids=gen.eos_ids, ...)

Prompt framing (`Tokenizer.framing`, the ids around a prompt's text): a run imported from a Hugging Face checkpoint
(`checkpoint.init_from = "hf:DIR"`) frames as its tokenizer's own post-processor does, as transformers'
`tokenizer(text)` and vLLM do (Llama 3: BOS; Qwen: nothing); a run trained here frames as its corpus framed every
document (core.corpus: BOS when the tokenizer has one), whatever its tokenizer files say (a tokenizer trained by
`experiments.tokenizer` before its files carried that rule says nothing).

Generation config (`--generation-config`, named as vLLM names it):
  auto    the model's generation_config.json: an imported run's checkpoint directory's, or, without one there, the
          generation fields of its config.json (transformers' `GenerationConfig.from_model_config`); a run trained
          here has none (its end id is its tokenizer's EOS, its sampling the server's defaults).
  vllm    the same end ids, and no sampling defaults (vLLM's neutral ones).
  FOLDER  FOLDER/generation_config.json for both (an error if it has none).
Its `eos_token_id` (an id or a list) joins the tokenizer's EOS as an end id. Its sampling keys, vLLM's
(`ModelConfig.get_diff_sampling_param`): temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens
(as `max_tokens`: a cap on every request's); each applies to a request that does not set it. `do_sample` is not read
(vLLM does not read it: `"do_sample": false` with a temperature still samples at that temperature), nor any other key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import ml_collections

from core import tokenizer as tokenizer_lib
from core.hf_tokenizer import HFTokenizer
from experiments.hf import load as hf_load

__all__ = ["GENERATION_FILE", "MODES", "GenerationConfig", "GenerationConfigError", "for_run", "read", "run_tokenizer"]

GENERATION_FILE = "generation_config.json"
MODES = ("auto", "vllm")
"""`--generation-config` values besides a folder."""

_SAMPLING = {  # generation_config key -> (its name in a request, the rule its value follows, that rule in words)
    "temperature": ("temperature", lambda v: _number(v) and v >= 0, "a number >= 0"),
    "top_p": ("top_p", lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": ("top_k", lambda v: _integer(v) and v >= -1, "an integer >= -1 (0 or -1: all)"),
    "min_p": ("min_p", lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": ("repetition_penalty", lambda v: _number(v) and v > 0, "a number > 0"),
    "max_new_tokens": ("max_tokens", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
}


class GenerationConfigError(ValueError):
    """A generation config that cannot be read or used: the message names the file, the field, the value and what
    is allowed."""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """eos_ids: the model's end ids (besides the tokenizer's EOS, which may be among them); defaults: request field
    -> value (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens), applied to requests that do not
    set the field; source: where they came from (a file, or a sentence saying there was none)."""

    eos_ids: tuple[int, ...] = ()
    defaults: dict[str, float | int] = dataclasses.field(default_factory=dict)
    source: str = "none"


def read(path: str, *, sampling: bool = True) -> GenerationConfig:
    """The GenerationConfig of a generation_config.json (or config.json) at `path`; `sampling` False leaves the
    sampling defaults out. Raises GenerationConfigError naming the file and field for a file that is no JSON object,
    an eos_token_id that is not an id or a list of ids, or a sampling value out of its range."""
    try:
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
    except OSError as e:
        raise GenerationConfigError(f"{path} cannot be read: {e.strerror}") from None
    except ValueError as e:
        raise GenerationConfigError(f"{path} is not JSON ({e})") from None
    if not isinstance(fields, dict):
        raise GenerationConfigError(f"{path} holds a JSON {type(fields).__name__}; expected an object")
    eos = fields.get("eos_token_id")
    ids = [] if eos is None else [eos] if not isinstance(eos, list) else eos
    if not all(_integer(i) and i >= 0 for i in ids):
        raise GenerationConfigError(
            f"{path}: eos_token_id = {json.dumps(eos)}; allowed: a token id (an integer >= 0), a list of them, or null"
        )
    defaults: dict[str, float | int] = {}
    for key, (name, ok, rule) in _SAMPLING.items():
        value = fields.get(key)
        if value is None or not sampling:
            continue
        if not ok(value):
            raise GenerationConfigError(f"{path}: {key} = {json.dumps(value)}; allowed: {rule} (or null)")
        defaults[name] = value
    return GenerationConfig(tuple(dict.fromkeys(ids)), defaults, path)


def for_run(config: ml_collections.ConfigDict, spec: str = "auto") -> GenerationConfig:
    """The generation config serving the run of `config` uses under `--generation-config spec` (the module
    docstring: "auto", "vllm" or a folder). Raises GenerationConfigError naming --generation-config for a folder
    without generation_config.json (or that does not exist), or as `read` for a file it cannot use."""
    if spec not in MODES:
        file = os.path.join(spec, GENERATION_FILE)
        if not os.path.isfile(file):
            why = "does not exist" if not os.path.exists(spec) else f"holds no {GENERATION_FILE}"
            raise GenerationConfigError(
                f"--generation-config={spec!r} {why}; allowed: auto (the model's), vllm (no sampling defaults) or a "
                f"folder holding {GENERATION_FILE}"
            )
        return read(file)
    directory, _ = hf_load.source_config(config)
    if directory is None:
        return GenerationConfig(source="none (a run trained here: its tokenizer's EOS ends a request)")
    for name in (GENERATION_FILE, "config.json"):
        file = os.path.join(directory, name)
        if os.path.isfile(file):
            return read(file, sampling=spec == "auto")
    return GenerationConfig(source=f"none ({directory} has no {GENERATION_FILE})")


def run_tokenizer(config: ml_collections.ConfigDict) -> tokenizer_lib.Tokenizer:
    """The run's tokenizer (`data.tokenizer`), framing prompts as the run's model was trained (the module docstring):
    its own framing for a run imported from a checkpoint; BOS (when it has one) and nothing after for a run trained
    here. Raises core.tokenizer.TokenizerError naming data.tokenizer."""
    tok = tokenizer_lib.load(config.data.tokenizer)
    if str(config.checkpoint.get("init_from", "") or ""):  # imported: framed as its checkpoint's files say
        return tok
    if isinstance(tok, HFTokenizer):
        return tok.with_framing(() if tok.bos_id is None else (tok.bos_id,))
    return tok
