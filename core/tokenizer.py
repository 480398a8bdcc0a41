"""Tokenizers: bytes (the default) or a Hugging Face ``tokenizer.json``, one interface for data and decoding.

Two implementations of one interface (:class:`Tokenizer`):

* :class:`ByteTokenizer` (``data.tokenizer = "bytes"``): ids ``0 .. 255`` are the byte values, then PAD (256),
  BOS (257), EOS (258); ``vocab_size`` 259. Embedded, nothing to load.
* :class:`HFTokenizer` (``data.tokenizer = path``): a byte-level BPE ``tokenizer.json`` (model type ``BPE`` with a
  ``ByteLevel`` decoder and pre-tokenizer, as GPT-2, Llama 3, Qwen2 / Qwen3 and ``python -m experiments.tokenizer
  train`` use), run by the ``tokenizers`` library. Its BOS / EOS / PAD are named by ``tokenizer_config.json`` beside
  it (``bos_token`` / ``eos_token`` / ``pad_token``: strings or ``{"content": ...}`` dicts), else they are the
  tokens our trainer writes, ``<|bos|>`` / ``<|eos|>`` / ``<|pad|>``, where the vocabulary has them. Other models
  (SentencePiece / Metaspace, WordPiece, Unigram, BPE with byte fallback) are refused: their pieces are not
  bytes, so neither exact streaming detokenisation nor bits per byte would hold.

What both guarantee:

* ``decode_bytes`` is concatenative (every id stands for fixed bytes: a byte-level token's bytes come from
  inverting GPT-2's bytes-to-unicode map of its token string, an added non-special token's from its UTF-8 content,
  a special token's are ``b""``), so :class:`StreamDecoder` can detokenise a stream chunk by chunk.
* ``byte_lengths[i]`` is how many bytes of text id ``i`` stands for, so the held-out bits per byte of any
  tokenizer is the total NLL over the bytes of the held-out text (``core.train.count_target_bytes``).
* ``encode`` reads its text literally: a special token's name inside the text is text (``"<|eos|>"`` is 7 bytes'
  worth of tokens), never the special id; specials come only from ``bos`` / ``eos``. So
  ``decode(encode(t)) == t`` for the byte tokenizer and for an ``HFTokenizer`` without a normalizer (one with a
  normalizer, e.g. Qwen2's NFC, round-trips text the normalizer leaves unchanged).
* ``save(directory)`` writes ``tokenizer.json`` + ``tokenizer_config.json`` that transformers'
  ``PreTrainedTokenizerFast`` / ``AutoTokenizer`` loads and that give the same ids (the byte tokenizer's is a BPE
  with no merges over the 256 byte-level characters, the specials at 256 .. 258).

Errors in user input raise :class:`TokenizerError` naming ``data.tokenizer`` or the file and field at fault, the
value and what is supported.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

__all__ = [
    "BOS_ID",
    "BOS_TOKEN",
    "CONFIG_FILE",
    "EOS_ID",
    "EOS_TOKEN",
    "NUM_BYTES",
    "PAD_ID",
    "PAD_TOKEN",
    "TOKENIZER_FILE",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "BytesDecoder",
    "HFTokenizer",
    "StreamDecoder",
    "Tokenizer",
    "TokenizerError",
    "byte_to_char",
    "load",
]

NUM_BYTES = 256  # the byte tokenizer's ids 0..255 are the byte values
PAD_ID = NUM_BYTES
BOS_ID = NUM_BYTES + 1
EOS_ID = NUM_BYTES + 2
VOCAB_SIZE = NUM_BYTES + 3  # the byte values + PAD, BOS, EOS

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"  # the specials' names in the files we write
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
_SUPPORTED = (
    "byte-level BPE: model.type 'BPE' with a 'ByteLevel' decoder and a 'ByteLevel' pre-tokenizer (GPT-2, Llama 3, "
    "Qwen2/3, and `python -m experiments.tokenizer train`)"
)


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded or used: the message names ``data.tokenizer`` or the file and field at fault."""


def byte_to_char() -> tuple[str, ...]:
    """GPT-2's bytes-to-unicode map as ``chars[b]`` for ``b`` in ``0 .. 255``: printable Latin-1 bytes (``!``..``~``,
    ``¡``..``¬``, ``®``..``ÿ``) map to themselves, the other 68 bytes to ``chr(256 + k)`` in byte order. Byte-level
    BPE vocabularies (and ``tokenizers.pre_tokenizers.ByteLevel.alphabet()``) are strings over these 256 chars."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + k) for k, b in enumerate(others)})
    return tuple(chars[b] for b in range(256))


_CHAR_TO_BYTE = {c: b for b, c in enumerate(byte_to_char())}  # byte_to_char inverted


class Tokenizer(Protocol):
    """The interface of every tokenizer (:class:`ByteTokenizer`, :class:`HFTokenizer`).

    Attributes (read-only):
      vocab_size: ids are ``[0, vocab_size)``; ``model.vocab_size`` must be at least this.
      pad_id: the padding id, or None when the tokenizer has none (or its pad token is also its BOS or EOS:
        masking it would mask those); ``core.train.lm_loss`` leaves targets equal to it out.
      bos_id: the id starting every document of a corpus, or None (then documents start without one).
      eos_id: the id ending every document, and generation.
      special_ids: ``int`` ids of the special tokens, ascending (they decode to ``b""``).
      special_tokens: the special tokens' names -> their ids (the strings a chat template writes for them).
      never_sampled: ids generation must never produce: the specials but EOS, and ids no token uses.
      byte_lengths: ``int32[vocab_size]``: how many bytes of text each id stands for (specials 0).
      digest: SHA-256 hex of the tokenizer's definition (part of a corpus fingerprint).
    """

    @property
    def vocab_size(self) -> int: ...
    @property
    def pad_id(self) -> int | None: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def special_ids(self) -> tuple[int, ...]: ...
    @property
    def special_tokens(self) -> dict[str, int]: ...
    @property
    def never_sampled(self) -> tuple[int, ...]: ...
    @property
    def byte_lengths(self) -> np.ndarray: ...
    @property
    def digest(self) -> str: ...

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """``int32[N]``: ``text``'s ids, after BOS (when ``bos`` and the tokenizer has one), then EOS if ``eos``."""
        ...

    def encode_bytes(self, raw: bytes, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """``int32[N]``: ``encode`` of bytes (for an :class:`HFTokenizer` decoded as UTF-8, invalid bytes as U+FFFD)."""
        ...

    def encode_batch(self, raws: Sequence[bytes], *, bos: bool = True, eos: bool = False) -> list[np.ndarray]:
        """``[encode_bytes(raw) for raw in raws]``, computed in one batch (in parallel for an HFTokenizer)."""
        ...

    def decode_bytes(self, ids: Sequence[int] | np.ndarray) -> bytes:
        """Concatenative bytes of 1-D integer ids in ``[0, vocab_size)``; specials give ``b""``."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """``decode_bytes(ids).decode("utf-8", errors="replace")``."""
        ...

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Writes ``tokenizer.json`` + ``tokenizer_config.json`` into ``directory`` (created if missing)."""
        ...


# --------------------------------------------------------------------------- bytes


def _ids_array(ids: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """``ids`` as a 1-D integer array checked to lie in ``[0, vocab_size)``; TokenizerError otherwise."""
    ids = np.asarray(ids)
    if ids.size == 0:
        return np.zeros(0, np.int64)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise TokenizerError(f"token ids must be a 1-D integer sequence, got shape {ids.shape} dtype {ids.dtype}")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        raise TokenizerError(f"token id {ids[bad][0]} is outside [0, {vocab_size})")
    return ids


def _check_bytes(raw: Any, where: str) -> bytes:
    if not isinstance(raw, (bytes, bytearray)):
        raise TypeError(f"{where} expects bytes, got {type(raw).__name__}")
    return bytes(raw)


class ByteTokenizer:
    """Stateless byte-level tokenizer: id ``i < NUM_BYTES`` (256) is byte ``i``; PAD, BOS, EOS follow."""

    vocab_size: ClassVar[int] = VOCAB_SIZE
    pad_id: ClassVar[int] = PAD_ID
    bos_id: ClassVar[int] = BOS_ID
    eos_id: ClassVar[int] = EOS_ID
    special_ids: ClassVar[tuple[int, ...]] = (PAD_ID, BOS_ID, EOS_ID)

    @property
    def special_tokens(self) -> dict[str, int]:
        return {PAD_TOKEN: PAD_ID, BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID}

    never_sampled: ClassVar[tuple[int, ...]] = (PAD_ID, BOS_ID)

    @property
    def byte_lengths(self) -> np.ndarray:
        """``int32[259]``: 1 for the byte ids, 0 for PAD, BOS, EOS."""
        lengths = np.zeros(VOCAB_SIZE, np.int32)
        lengths[:NUM_BYTES] = 1
        return lengths

    @property
    def digest(self) -> str:
        """SHA-256 hex of the ``tokenizer.json`` :meth:`save` writes and the special ids (a corpus fingerprint
        leaves it out)."""
        return _digest(self._definition(), bos=BOS_ID, eos=EOS_ID, pad=PAD_ID)

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """UTF-8 bytes of ``text`` as ``int32[len(text.encode()) + bos + eos]``, optionally framed by BOS/EOS."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode expects str, got {type(text).__name__}")
        return self.encode_bytes(text.encode("utf-8"), bos=bos, eos=eos)

    def encode_bytes(self, raw: bytes, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """``int32[len(raw) + bos + eos]``: the bytes ``raw`` as they are (valid UTF-8 or not), optionally framed
        by BOS/EOS. ``encode(text)`` is ``encode_bytes(text.encode("utf-8"))``."""
        raw = _check_bytes(raw, "ByteTokenizer.encode_bytes")
        prefix = np.array([BOS_ID] if bos else [], np.int32)
        suffix = np.array([EOS_ID] if eos else [], np.int32)
        return np.concatenate([prefix, np.frombuffer(raw, np.uint8), suffix], dtype=np.int32)

    def encode_batch(self, raws: Sequence[bytes], *, bos: bool = True, eos: bool = False) -> list[np.ndarray]:
        """``[encode_bytes(raw, bos=bos, eos=eos) for raw in raws]``."""
        return [self.encode_bytes(raw, bos=bos, eos=eos) for raw in raws]

    def decode_bytes(self, ids: Sequence[int] | np.ndarray) -> bytes:
        """Bytes of a 1-D integer sequence in ``[0, VOCAB_SIZE)``: byte tokens as themselves, specials dropped.

        Concatenative: ``decode_bytes(a + b) == decode_bytes(a) + decode_bytes(b)`` (the :class:`BytesDecoder`
        contract that :class:`StreamDecoder` relies on). Raises TokenizerError for another shape, dtype or id.
        """
        ids = _ids_array(ids, VOCAB_SIZE)
        return ids[ids < NUM_BYTES].astype(np.uint8).tobytes()

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of a 1-D integer sequence in ``[0, VOCAB_SIZE)``; specials are dropped, invalid UTF-8 is replaced
        (U+FFFD per maximal invalid subsequence, as ``bytes.decode(errors="replace")``). To decode a stream piece by
        piece, use :class:`StreamDecoder`: decoding each piece on its own breaks characters split between pieces."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Writes ``tokenizer.json`` (a byte-level BPE without merges: byte ``b`` is id ``b``, written as GPT-2's
        character for it; ``<|pad|>``, ``<|bos|>``, ``<|eos|>`` are the special ids 256, 257, 258) and
        ``tokenizer_config.json`` into ``directory``: transformers' ``PreTrainedTokenizerFast`` loads them and gives
        the ids of :meth:`encode` with ``bos=False``."""
        _write(directory, self._definition(), _specials_config(PAD_TOKEN, BOS_TOKEN, EOS_TOKEN))

    @staticmethod
    def _definition() -> str:
        """The byte tokenizer as a Hugging Face ``tokenizer.json`` text (the ``tokenizers`` library's layout)."""
        added = [
            {
                "id": i,
                "content": name,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, name in ((PAD_ID, PAD_TOKEN), (BOS_ID, BOS_TOKEN), (EOS_ID, EOS_TOKEN))
        ]
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        model: dict[str, Any] = {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {c: b for b, c in enumerate(byte_to_char())},
            "merges": [],
        }
        definition = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": byte_level,
            "post_processor": None,
            "decoder": byte_level,
            "model": model,
        }
        return json.dumps(definition, indent=2, ensure_ascii=False)


# --------------------------------------------------------------------------- Hugging Face tokenizer.json


def _specials_config(pad: str | None, bos: str | None, eos: str) -> dict[str, Any]:
    """The ``tokenizer_config.json`` we write: transformers' fast tokenizer over ``tokenizer.json`` with these
    specials, no post-processing of the decoded text and no BOS / EOS added by transformers itself."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


def _digest(definition: str, *, bos: int | None, eos: int, pad: int | None) -> str:
    """SHA-256 hex of a tokenizer.json text and the special ids that frame and mask a corpus: what fixes the ids of
    a corpus and its loss (other tokenizer_config.json entries, such as a chat template, do not)."""
    h = hashlib.sha256(definition.encode("utf-8"))
    h.update(b"\0" + json.dumps({"bos": bos, "eos": eos, "pad": pad}, sort_keys=True).encode("utf-8"))
    return h.hexdigest()


def _write(directory: str | os.PathLike[str], definition: str, config: Mapping[str, Any]) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, TOKENIZER_FILE), "w", encoding="utf-8") as f:
        f.write(definition)
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


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
        from tokenizers import Tokenizer as _Library

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
        to_byte = _CHAR_TO_BYTE
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
        return _digest(self._definition, bos=self._bos_id, eos=self._eos_id, pad=self._pad_id)

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """``int32[N]``: BOS (if ``bos`` and the tokenizer has one), the BPE ids of ``text`` read literally (no
        post-processor template, special names in the text are text), EOS if ``eos``."""
        if not isinstance(text, str):
            raise TypeError(f"HFTokenizer.encode expects str, got {type(text).__name__}")
        return self._frame(self._tok.encode(text, add_special_tokens=False).ids, bos, eos)

    def encode_bytes(self, raw: bytes, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """``encode(raw.decode("utf-8", errors="replace"))``: invalid UTF-8 becomes U+FFFD (a BPE reads text)."""
        raw = _check_bytes(raw, "HFTokenizer.encode_bytes")
        return self.encode(raw.decode("utf-8", errors="replace"), bos=bos, eos=eos)

    def encode_batch(self, raws: Sequence[bytes], *, bos: bool = True, eos: bool = False) -> list[np.ndarray]:
        """``[encode_bytes(raw, bos=bos, eos=eos) for raw in raws]``, encoded by the library in parallel."""
        texts = [_check_bytes(raw, "HFTokenizer.encode_batch").decode("utf-8", errors="replace") for raw in raws]
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # _fast: no offsets (tokenizers 0.21+)
        return [self._frame(e.ids, bos, eos) for e in batch(texts, add_special_tokens=False)]

    def _frame(self, ids: Sequence[int], bos: bool, eos: bool) -> np.ndarray:
        head = [self._bos_id] if bos and self._bos_id is not None else []
        tail = [self._eos_id] if eos else []
        return np.array([*head, *ids, *tail], np.int32)

    def decode_bytes(self, ids: Sequence[int] | np.ndarray) -> bytes:
        """Concatenation of each id's bytes (specials ``b""``); TokenizerError for another shape, dtype or id."""
        pieces = self._pieces
        return b"".join([pieces[i] for i in _ids_array(ids, len(pieces)).tolist()])

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """``decode_bytes(ids).decode("utf-8", errors="replace")``."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Writes the ``tokenizer.json`` text as loaded and ``tokenizer_config.json``: the one it was loaded with,
        else ours (``PreTrainedTokenizerFast`` with these specials), into ``directory``."""
        names = self._names
        config = self._config or _specials_config(names["pad"], names["bos"], names["eos"] or EOS_TOKEN)
        _write(directory, self._definition, config)


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


def load(spec: str) -> ByteTokenizer | HFTokenizer:
    """The tokenizer ``data.tokenizer = spec`` names: ``"bytes"`` -> :class:`ByteTokenizer`; a path to a
    ``tokenizer.json`` or to a directory holding one -> :class:`HFTokenizer` (``HFTokenizer.from_file``).

    Raises:
      TokenizerError: naming ``data.tokenizer``, the value and what is allowed (a missing path, a directory without
        ``tokenizer.json``, a file that is not JSON or not a supported tokenizer).
    """
    allowed = "'bytes' or a path to a Hugging Face tokenizer.json (or to a directory holding one)"
    if not isinstance(spec, str) or not spec:
        raise TokenizerError(f"data.tokenizer={spec!r}; allowed: {allowed}")
    if spec == "bytes":
        return ByteTokenizer()
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, TOKENIZER_FILE)):
            raise TokenizerError(
                f"data.tokenizer={spec!r} is a directory without a {TOKENIZER_FILE}; allowed: {allowed}"
            )
    elif not os.path.isfile(spec):
        raise TokenizerError(f"data.tokenizer={spec!r} does not exist; allowed: {allowed}")
    try:
        return HFTokenizer.from_file(spec)
    except TokenizerError as e:
        raise TokenizerError(f"data.tokenizer={spec!r}: {e}") from None


# --------------------------------------------------------------------------- streaming detokenisation


class BytesDecoder(Protocol):
    """What :class:`StreamDecoder` needs of a tokenizer: token ids to the bytes they stand for.

    ``decode_bytes(ids)`` takes a 1-D integer sequence (list or ``int[N]`` array, possibly empty) and must be
    concatenative, ``decode_bytes(a + b) == decode_bytes(a) + decode_bytes(b)``: each token's bytes do not depend
    on its neighbours (true of byte tokens and of byte-level BPE; an adapter for a tokenizer whose pieces depend on
    context, e.g. SentencePiece's leading space, must make it so). Special tokens map to ``b""``.
    """

    def decode_bytes(self, ids: Sequence[int] | np.ndarray) -> bytes: ...


class StreamDecoder:
    """Streaming detokenisation: token ids in, chunk by chunk; out, the text that is complete so far.

    ``feed(ids)`` returns the new text of ``ids`` together with what came before, holding back the trailing bytes of
    a UTF-8 character whose remaining bytes may still come (at most 3 bytes); ``flush()`` ends the stream: it
    returns what was held back (U+FFFD for a truncated character) and starts afresh. For any split of ``ids`` into
    chunks ``c_1 .. c_n``::

        feed(c_1) + ... + feed(c_n) + flush() == tokenizer.decode_bytes(ids).decode("utf-8", errors="replace")

    which is ``tokenizer.decode(ids)``: a character split between chunks (or between the pieces of two BPE tokens)
    comes out whole, and invalid bytes become U+FFFD exactly where whole decoding puts them (the standard library's
    incremental UTF-8 decoder). Every returned piece extends the text so far: nothing returned is ever taken back.

    Args:
      tokenizer: any :class:`BytesDecoder` (``ByteTokenizer``, ``HFTokenizer``, an adapter of another vocabulary).
    """

    def __init__(self, tokenizer: BytesDecoder):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text completed by ``ids`` (1-D integer ids, possibly empty; errors as ``tokenizer.decode_bytes``)."""
        return self._utf8.decode(self.tokenizer.decode_bytes(ids))

    def flush(self) -> str:
        """The held-back end of the stream (``""``, or U+FFFD for a truncated character); the decoder is reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
