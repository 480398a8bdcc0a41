"""A Hugging Face byte-level BPE tokenizer (``tokenizer.json``), run by the ``tokenizers`` library: an optional
dependency (the [experiments] extra), imported only when such a tokenizer is loaded. Other models (SentencePiece /
Metaspace, WordPiece, Unigram, BPE with byte fallback) are refused: their pieces are not bytes, so neither exact
streaming detokenisation nor bits per byte would hold (core.tokenizer states the interface)."""

from __future__ import annotations

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
    its UTF-8 content; a special's are ``b""``. A pad token that is also BOS or EOS gives ``pad_id`` None.

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
        self._definition, self._config, self.source = definition, None if config is None else dict(config), source
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
        self._lengths = np.array([len(p) for p in self._pieces], np.int32)
        self._lengths.flags.writeable = False
        self._bos_id, self._eos_id, self._pad_id, self._names = self._resolve_specials(config, source)

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
        return tuple(sorted({*self._special_ids, *self._holes} - {self._eos_id}))

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

    def decode_bytes(self, ids: Sequence[int] | np.ndarray) -> bytes:
        """Concatenation of each id's bytes (specials ``b""``); TokenizerError for another shape, dtype or id."""
        pieces = self._pieces
        return b"".join([pieces[i] for i in ids_array(ids, len(pieces)).tolist()])

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """``decode_bytes(ids).decode("utf-8", errors="replace")``."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Writes the ``tokenizer.json`` text as loaded and ``tokenizer_config.json``: the one it was loaded with,
        else ours (``PreTrainedTokenizerFast`` with these specials), into ``directory``."""
        names = self._names
        config = self._config or specials_config(names["pad"], names["bos"], names["eos"] or EOS_TOKEN)
        write_files(directory, self._definition, config)


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
