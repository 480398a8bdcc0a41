"""Chat templates: messages -> the prompt's token ids, as transformers' `apply_chat_template` makes them.

The template is a Jinja2 string: `--chat-template FILE` if given, else the tokenizer's (`chat_template` in the
tokenizer_config.json beside its tokenizer.json: a string, or a list of named templates of which "default" is used;
or a chat_template.jinja file there). It is rendered as transformers renders it: a sandboxed environment with
trim_blocks and lstrip_blocks, the variables `messages`, `add_generation_prompt=True`, `bos_token` and `eos_token`,
and `raise_exception(message)`. The text is then tokenized as transformers' `apply_chat_template(tokenize=True)`
tokenizes it (`Tokenizer.encode_prompt(text, add_special_tokens=False)`): special tokens' names are those tokens
(a template writes `<|im_start|>` for that token; a name inside a message's content is that token too, as in
transformers and vLLM), and no BOS is added: a template writes its own (Llama 3's `{{ bos_token }}`), so a prompt
never gets two. `add_special_tokens=True` (vLLM's request field) adds the tokenizer's framing all the same.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from core.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "TemplateError", "find_template", "load_template"]

TEMPLATE_FILE = "chat_template.jinja"


class TemplateError(ValueError):
    """A template that cannot be read, compiled or rendered (its message names the source and the reason)."""


def find_template(tokenizer_spec: str) -> tuple[str, str] | None:
    """(template, where it came from) of the tokenizer `data.tokenizer = tokenizer_spec` names, or None ('bytes',
    or a tokenizer without one). Raises TemplateError for a config whose `chat_template` has no usable template."""
    if tokenizer_spec == "bytes":
        return None
    directory = tokenizer_spec if os.path.isdir(tokenizer_spec) else os.path.dirname(tokenizer_spec)
    config_file = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
            if template is None:
                raise TemplateError(
                    f"{config_file}: chat_template lists templates {sorted(map(str, named))} but none named "
                    "'default'; pass --chat-template FILE"
                )
        if isinstance(template, str):
            return template, f"{config_file} (chat_template)"
    jinja_file = os.path.join(directory, TEMPLATE_FILE)
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read(), jinja_file
    return None


def load_template(path: str | None, tokenizer_spec: str, tokenizer: Tokenizer) -> ChatTemplate | None:
    """The chat template of the file `path` (`--chat-template`) if given, else of the tokenizer `data.tokenizer =
    tokenizer_spec` names (`find_template`), else None. Raises TemplateError naming --chat-template for a file that
    cannot be read, or naming the source for a template that does not compile."""
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                return ChatTemplate(f.read(), tokenizer, source=path)
        except OSError as e:
            raise TemplateError(f"--chat-template={path!r} cannot be read: {e.strerror}") from None
    found = find_template(tokenizer_spec)
    return None if found is None else ChatTemplate(found[0], tokenizer, source=found[1])


class ChatTemplate:
    """A compiled chat template for `tokenizer` (module docstring). Raises TemplateError naming `source` if the
    template does not compile."""

    def __init__(self, template: str, tokenizer: Tokenizer, *, source: str):
        def raise_exception(message):
            raise TemplateError(f"the chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals.update(
            raise_exception=raise_exception,
            strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt),
        )
        try:
            self._template: jinja2.Template = env.from_string(template)
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template from {source} does not compile: {e}") from None
        self.tokenizer, self.source = tokenizer, source
        names = {v: k for k, v in tokenizer.special_tokens.items()}
        bos = "" if tokenizer.bos_id is None else names.get(tokenizer.bos_id, "")
        self._names = {"bos_token": bos, "eos_token": names.get(tokenizer.eos_id, "")}

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt's text for `messages` (dicts with role and content), ending with the assistant's turn."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._names)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template from {self.source} failed on these messages: {e}") from None

    def encode(self, messages: list[dict[str, Any]], *, add_special_tokens: bool = False) -> list[int]:
        """`render(messages)` as token ids (module docstring): special tokens' names become their ids, the rest is
        text; the tokenizer's framing only with `add_special_tokens`."""
        return self.tokenizer.encode_prompt(self.render(messages), add_special_tokens=add_special_tokens).tolist()
