"""A Hugging Face byte-level BPE tokenizer (``tokenizer.json``), run by the ``tokenizers`` library: an optional
dependency (the [experiments] extra), imported only when such a tokenizer is loaded. Other models (SentencePiece /
Metaspace, WordPiece, Unigram, BPE with byte fallback) are refused: their pieces are not bytes, so neither exact
streaming detokenisation nor bits per byte would hold (core.tokenizer states the interface).

Framing (what a prompt gets around its text, ``HFTokenizer.framing``): the ids the tokenizer.json's
``post_processor`` adds (a ``TemplateProcessing`` ``"<|begin_of_text|> $A"``: Llama 3's BOS; ``ByteLevel`` or null:
none, as Qwen2 / Qwen3), found by running it: what transformers' ``tokenizer(text)`` adds. transformers 5 reads
nothing else beside a tokenizer.json (``tokenizer_config.json``'s ``add_bos_token`` / ``add_eos_token`` are
dropped when a tokenizer.json exists: checked with transformers 5.25 for eight tokenizer classes), so neither does
this. A tokenizer.json without post-processor and without a tokenizer_config.json is our trainer's
(``experiments.tokenizer``): it frames with its BOS, as the corpora it tokenizes do, and :meth:`HFTokenizer.save`
writes that as a post-processor. ``with_framing`` gives a copy with other framing (a run trained here frames as its
corpus did: ``experiments.hf.generation.run_tokenizer``)."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from core.byte_tokenizer import (
    BOS_TOKEN,
    CHAR_TO_BYTE,
    CONFIG_FILE,
    EOS_TOKEN,
    PAD_TOKEN,
    TOKENIZER_FILE,
    TokenizerError,
    check_bytes,
    definition_digest,
    ids_array,
    specials_config,
    template_processing,
    write_files,
)

__all__ = ["HFTokenizer"]

_SUPPORTED = (
    "byte-level BPE: model.type 'BPE' with a 'ByteLevel' decoder and a 'ByteLevel' pre-tokenizer (GPT-2, Llama 3, "
    "Qwen2/3, and `python -m experiments.tokenizer train`)"
)


def _component_types(component: Any) -> list[dict]:
    """The parts of a pre-tokenizer / decoder entry: itself, or the members of a ``Sequence``."""
    if not isinstance(component, dict):
        return []
    if component.get("type") == "Sequence":
        members = component.get("pretokenizers", component.get("decoders"))
        return [m for m in members or [] if isinstance(m, dict)]
    return [component]


def _check_definition(definition: Any, where: str) -> None:
    """Raises TokenizerError naming ``where`` (the file) and the field unless ``definition`` (a parsed
    tokenizer.json) is a byte-level BPE."""
    if not isinstance(definition, dict) or not isinstance(definition.get("model"), dict):
        raise TokenizerError(f"{where} has no 'model' object; expected a Hugging Face tokenizer.json ({_SUPPORTED})")
    model = definition["model"]
    kind = model.get("type", "BPE" if "merges" in model else None)
    if kind != "BPE":
        raise TokenizerError(f"{where}: model.type = {kind!r} is not supported; supported: {_SUPPORTED}")
    if model.get("byte_fallback"):
        raise TokenizerError(
            f"{where}: model.byte_fallback = true (a SentencePiece-style BPE) is not supported; supported: {_SUPPORTED}"
        )
    decoder = definition.get("decoder")
    if [d.get("type") for d in _component_types(decoder)] != ["ByteLevel"]:
        shown = decoder.get("type") if isinstance(decoder, dict) else decoder
        raise TokenizerError(
            f"{where}: decoder = {shown!r} (parts {[d.get('type') for d in _component_types(decoder)]}) is not "
            f"supported; supported: {_SUPPORTED}"
        )
    pre = [p for p in _component_types(definition.get("pre_tokenizer")) if p.get("type") == "ByteLevel"]
    if not pre:
        shown = definition.get("pre_tokenizer")
        raise TokenizerError(
            f"{where}: pre_tokenizer = {shown if shown is None else shown.get('type')!r} has no 'ByteLevel' part; "
            f"supported: {_SUPPORTED}"
        )
    if any(p.get("add_prefix_space") for p in pre):
        raise TokenizerError(
            f"{where}: pre_tokenizer ByteLevel add_prefix_space = true is not supported (it adds a space the text "
            "does not hold, so decoding would not give the text back); supported: add_prefix_space false"
        )


def _token_name(config: Mapping[str, Any], key: str, where: str) -> str | None:
    """``config[key]`` as a token string: absent or null -> None, a string, or a dict's ``content``."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise TokenizerError(f"{where}: {key} = {config.get(key)!r}; expected a string, {{'content': str}} or null")
    return value


class HFTokenizer:
    """A byte-level BPE Hugging Face tokenizer (``tokenizer.json``, run by the ``tokenizers`` library).

    Args:
      definition: the text of a ``tokenizer.json``.
      config: the parsed ``tokenizer_config.json`` naming ``bos_token`` / ``eos_token`` / ``pad_token`` (a string, a
        ``{"content": ...}`` dict, or null for none), or None. A key it does not have (or all, for None) is the
        name our trainer gives, ``<|bos|>`` / ``<|eos|>`` / ``<|pad|>``, where the vocabulary has it.
      source: what to name in errors (the file, or where the definition came from).

    Ids: ``vocab_size`` is the library's vocabulary size with added tokens (and past the largest id). Id ``i``'s
    bytes are GPT-2's byte-to-unicode map inverted over its token string; an added non-special token's bytes are
    its UTF-8 content; a special's are ``b""`` (its name with ``skip_special_tokens=False``). A pad token that is
    also BOS or EOS gives ``pad_id`` None. ``framing``: the module docstring's.

    Raises:
      TokenizerError: not a byte-level BPE (naming ``model.type`` / ``decoder`` / ``pre_tokenizer``), a token
        string outside the byte-level alphabet, a configured special missing from the vocabulary, or no EOS.
    """

    def __init__(self, definition: str, *, config: Mapping[str, Any] | None = None, source: str = "tokenizer.json"):
        try:
            parsed = json.loads(definition)
        except json.JSONDecodeError as e:
            raise TokenizerError(
                f"{source} is not JSON ({e.msg} at line {e.lineno} column {e.colno}); expected a Hugging Face "
                "tokenizer.json"
            ) from None
        _check_definition(parsed, source)
        try:
            from tokenizers import Tokenizer as _Library  # optional dependency: only an HFTokenizer needs it
        except ImportError as e:
            raise TokenizerError(
                f"{source}: a Hugging Face tokenizer needs the package tokenizers ({e}); install it (pip install "
                "'lowbit-moe-lab[experiments]') or use data.tokenizer = 'bytes'"
            ) from None

        try:
            self._tok = _Library.from_str(definition)
        except Exception as e:  # the library raises a bare Exception for a malformed definition
            raise TokenizerError(f"{source} cannot be read by the tokenizers library: {e}") from None
        self._tok.encode_special_tokens = True  # text is text: a special's name in it is not the special
        self._prompts = _Library.from_str(definition)  # prompts: a special's name in them is the special
        for library in (self._tok, self._prompts):  # a definition's truncation / padding never cuts or pads our ids
            library.no_truncation()
            library.no_padding()
        self._definition, self._config, self.source = definition, None if config is None else dict(config), source
        self._processed = parsed.get("post_processor") is not None
        added = self._tok.get_added_tokens_decoder()
        vocab = parsed["model"].get("vocab") or {}
        size = max([self._tok.get_vocab_size(with_added_tokens=True), *(i + 1 for i in vocab.values()), *added])
        table: list[bytes | None] = [None] * size
        to_byte = CHAR_TO_BYTE
        for token, i in vocab.items():
            try:
                table[i] = bytes(to_byte[c] for c in token)
            except KeyError as e:
                raise TokenizerError(
                    f"{source}: model.vocab token {token!r} (id {i}) holds {e.args[0]!r}, not a byte-level character; "
                    f"supported: {_SUPPORTED}"
                ) from None
        specials = []
        self._special_tokens: dict[str, int] = {}
        for i, token in added.items():
            table[i] = b"" if token.special else token.content.encode("utf-8")
            if token.special:
                specials.append(i)
                self._special_tokens[token.content] = i
        self._pieces: list[bytes] = [b"" if piece is None else piece for piece in table]
        self._holes = tuple(i for i, piece in enumerate(table) if piece is None)
        self._special_ids = tuple(sorted(specials))
        self._special_set = frozenset(specials)
        self._lengths = np.array([len(p) for p in self._pieces], np.int32)
        self._lengths.flags.writeable = False
        self._names_of = {i: token.content for i, token in added.items()}  # added tokens' text (specials' names)
        self._bos_id, self._eos_id, self._pad_id, self._names = self._resolve_specials(config, source)
        self._own = self._post_processed() if self._processed or config is not None else self._bos_framing()
        self._framing = self._own

    def _post_processed(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prefix, suffix): the ids the tokenizer.json's post-processor puts around a text's own ids (none without
        one), found by encoding a one-character text with and without it."""
        bare = self._prompts.encode("a", add_special_tokens=False).ids
        framed = self._prompts.encode("a", add_special_tokens=True).ids
        for start in range(len(framed) - len(bare) + 1):
            if framed[start : start + len(bare)] == bare:
                return tuple(framed[:start]), tuple(framed[start + len(bare) :])
        raise TokenizerError(f"{self.source}: post_processor changes a text's own ids ({bare} -> {framed})")

    def _bos_framing(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return ((self._bos_id,) if self._bos_id is not None else ()), ()

    def with_framing(self, prefix: Sequence[int], suffix: Sequence[int] = ()) -> HFTokenizer:
        """A copy framing prompts with ``prefix`` / ``suffix`` (ids in the vocabulary); everything else shared."""
        for i in [*prefix, *suffix]:
            ids_array([i], self.vocab_size)
        out = copy.copy(self)
        out._framing = (tuple(int(i) for i in prefix), tuple(int(i) for i in suffix))
        return out

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> HFTokenizer:
        """Loads ``path`` (a ``tokenizer.json``, or a directory holding one) with the ``tokenizer_config.json`` beside
        it when there is one. Raises TokenizerError naming the file for anything unreadable or unsupported."""
        path = os.fspath(path)
        file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
        definition = _read_text(file)
        config_file = os.path.join(os.path.dirname(file), CONFIG_FILE)
        config = None
        if os.path.exists(config_file):
            try:
                config = json.loads(_read_text(config_file))
            except json.JSONDecodeError as e:
                raise TokenizerError(
                    f"{config_file} is not JSON ({e.msg} at line {e.lineno} column {e.colno})"
                ) from None
            if not isinstance(config, dict):
                raise TokenizerError(f"{config_file} holds a JSON {type(config).__name__}; expected an object")
        return cls(definition, config=config, source=file)

    def _resolve_specials(
        self, config: Mapping[str, Any] | None, source: str
    ) -> tuple[int | None, int, int | None, dict[str, str | None]]:
        """(bos, eos, pad) ids and their names: ``config``'s ``{key}_token`` where it has the key (null: none), else
        the fixed name where the vocabulary has it."""
        fixed = {"bos": BOS_TOKEN, "eos": EOS_TOKEN, "pad": PAD_TOKEN}
        where = f"{source} (no {CONFIG_FILE} beside it)"
        if config is not None:
            where = os.path.join(os.path.dirname(source), CONFIG_FILE)
        names: dict[str, str | None] = {}
        ids: dict[str, int | None] = {}
        for key, default in fixed.items():
            if config is not None and f"{key}_token" in config:
                name = names[key] = _token_name(config, f"{key}_token", where)
                ids[key] = None if name is None else self._tok.token_to_id(name)
                if name is not None and ids[key] is None:
                    raise TokenizerError(f"{where}: {key}_token = {name!r} is not in the vocabulary of {source}")
            else:
                ids[key] = self._tok.token_to_id(default)
                names[key] = default if ids[key] is not None else None
        eos = ids["eos"]
        if eos is None:
            raise TokenizerError(
                f"{where}: no end-of-sequence token; {CONFIG_FILE} must name one (eos_token), or the vocabulary "
                f"must hold {EOS_TOKEN!r}"
            )
        pad = ids["pad"] if ids["pad"] not in (ids["bos"], eos) else None
        return ids["bos"], eos, pad, names

    # The interface (see Tokenizer).
    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def special_ids(self) -> tuple[int, ...]:
        return self._special_ids

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special_tokens)

    @property
    def never_sampled(self) -> tuple[int, ...]:
        """PAD, BOS and the ids no token uses: other specials (a chat model's end of turn, tool or reasoning
        markers) are sampled, as transformers and vLLM sample them."""
        specials = {i for i in (self._pad_id, self._bos_id) if i is not None and i != self._eos_id}
        return tuple(sorted({*specials, *self._holes}))

    @property
    def framing(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prefix ids, suffix ids) ``encode_prompt`` puts around a prompt's text (the module docstring)."""
        return self._framing

    @property
    def byte_lengths(self) -> np.ndarray:
        return self._lengths

    @property
    def digest(self) -> str:
        """SHA-256 hex of the ``tokenizer.json`` text and the BOS / EOS / PAD ids."""
        return definition_digest(self._definition, bos=self._bos_id, eos=self._eos_id, pad=self._pad_id)

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """``int32[N]``: BOS (if ``bos`` and the tokenizer has one), the BPE ids of ``text`` read literally (no
        post-processor template, special names in the text are text), EOS if ``eos``."""
        if not isinstance(text, str):
            raise TypeError(f"HFTokenizer.encode expects str, got {type(text).__name__}")
        return self._frame(self._tok.encode(text, add_special_tokens=False).ids, bos, eos)

    def encode_bytes(self, raw: bytes, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """``encode(raw.decode("utf-8", errors="replace"))``: invalid UTF-8 becomes U+FFFD (a BPE reads text)."""
        raw = check_bytes(raw, "HFTokenizer.encode_bytes")
        return self.encode(raw.decode("utf-8", errors="replace"), bos=bos, eos=eos)

    def encode_batch(self, raws: Sequence[bytes], *, bos: bool = True, eos: bool = False) -> list[np.ndarray]:
        """``[encode_bytes(raw, bos=bos, eos=eos) for raw in raws]``, encoded by the library in parallel."""
        texts = [check_bytes(raw, "HFTokenizer.encode_batch").decode("utf-8", errors="replace") for raw in raws]
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # _fast: no offsets (tokenizers 0.21+)
        return [self._frame(e.ids, bos, eos) for e in batch(texts, add_special_tokens=False)]

    def _frame(self, ids: Sequence[int], bos: bool, eos: bool) -> np.ndarray:
        head = [self._bos_id] if bos and self._bos_id is not None else []
        tail = [self._eos_id] if eos else []
        return np.array([*head, *ids, *tail], np.int32)

    def encode_prompt(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
        """``int32[N]``: ``text`` as a model's input, the ids of transformers' ``tokenizer(text, add_special_tokens=
        ...).input_ids``: the library's added tokens matched in the text (a special's name is the special), then
        ``framing`` around them when ``add_special_tokens``."""
        if not isinstance(text, str):
            raise TypeError(f"HFTokenizer.encode_prompt expects str, got {type(text).__name__}")
        ids = self._prompts.encode(text, add_special_tokens=False).ids
        if not add_special_tokens:
            return np.array(ids, np.int32)
        prefix, suffix = self._framing
        return np.array([*prefix, *ids, *suffix], np.int32)

    def decode_bytes(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> bytes:
        """Concatenation of each id's bytes (specials ``b""``, or their names' UTF-8 with ``skip_special_tokens=
        False``, as transformers' ``decode`` writes them); TokenizerError for another shape, dtype or id."""
        pieces, checked = self._pieces, ids_array(ids, len(self._pieces)).tolist()
        if skip_special_tokens:
            return b"".join([pieces[i] for i in checked])
        names, specials = self._names_of, self._special_set
        return b"".join([names[i].encode() if i in specials else pieces[i] for i in checked])

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> str:
        """``decode_bytes(ids, skip_special_tokens=...).decode("utf-8", errors="replace")``."""
        return self.decode_bytes(ids, skip_special_tokens=skip_special_tokens).decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``: the files as loaded when they
        already frame prompts as this tokenizer does (transformers then gives ``encode_prompt``'s ids); else the
        tokenizer.json with a ``TemplateProcessing`` post-processor of ``framing`` in place of its own and the
        config (the one loaded, else ours: ``PreTrainedTokenizerFast`` with these specials) saying
        ``add_bos_token`` / ``add_eos_token`` to match."""
        names, (prefix, suffix) = self._names, self._framing
        keep = self._framing == self._own and (self._processed or self._framing == ((), ()))
        if keep and self._config is not None:
            write_files(directory, self._definition, self._config)
            return
        definition = self._definition
        if not keep:
            parsed = json.loads(definition)
            parsed["post_processor"] = template_processing(
                [(self._token(i), i) for i in prefix], [(self._token(i), i) for i in suffix]
            )
            definition = json.dumps(parsed, indent=2, ensure_ascii=False)
        flags = {"add_bos_token": prefix == (self._bos_id,), "add_eos_token": suffix == (self._eos_id,)}
        ours = specials_config(names["pad"], names["bos"], names["eos"] or EOS_TOKEN)
        write_files(directory, definition, {**(self._config or ours), **flags})

    def _token(self, i: int) -> str:
        """Id ``i``'s token string (an added token's content); TokenizerError for an id no token uses."""
        name = self._names_of.get(i) or self._tok.id_to_token(i)
        if name is None:
            raise TokenizerError(f"{self.source}: id {i} is no token; a framing id must be one")
        return name


def _read_text(file: str) -> str:
    try:
        with open(file, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise TokenizerError(f"{file} does not exist") from None
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{file} is not UTF-8 text (byte {e.start}); expected a JSON file") from None
    except OSError as e:
        raise TokenizerError(f"{file} cannot be read ({e.strerror})") from None
