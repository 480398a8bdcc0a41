"""The byte tokenizer (the default, ``data.tokenizer = "bytes"``) and what every tokenizer shares: the special
tokens' ids and names, GPT-2's byte-level alphabet, the error type, the checks of ids and bytes, the split of a
text at special tokens' names, and the ``tokenizer.json`` + ``tokenizer_config.json`` files both write
(core.tokenizer is the interface)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

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
    "TokenizerError",
    "byte_to_char",
]

NUM_BYTES = 256  # the byte tokenizer's ids 0..255 are the byte values
PAD_ID = NUM_BYTES
BOS_ID = NUM_BYTES + 1
EOS_ID = NUM_BYTES + 2
VOCAB_SIZE = NUM_BYTES + 3  # the byte values + PAD, BOS, EOS

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"  # the specials' names in the files we write
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


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


CHAR_TO_BYTE = {c: b for b, c in enumerate(byte_to_char())}  # byte_to_char inverted


def ids_array(ids: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
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


def check_bytes(raw: Any, where: str) -> bytes:
    if not isinstance(raw, (bytes, bytearray)):
        raise TypeError(f"{where} expects bytes, got {type(raw).__name__}")
    return bytes(raw)


class ByteTokenizer:
    """Stateless byte-level tokenizer: id ``i < NUM_BYTES`` (256) is byte ``i``; PAD, BOS, EOS follow. A prompt is
    framed with BOS (``framing``): every document of a byte corpus begins with it, and the files :meth:`save` writes
    say so to transformers (a ``TemplateProcessing`` post-processor ``<|bos|> $A``)."""

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
    def framing(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``((BOS_ID,), ())``: a prompt starts with BOS, as every document of a byte corpus does."""
        return (BOS_ID,), ()

    @property
    def digest(self) -> str:
        """SHA-256 hex of the byte tokenizer's ``tokenizer.json`` as :meth:`save` wrote it before it carried the BOS
        post-processor, and the special ids: a fixed value, so corpora fingerprinted before keep their fingerprint
        (a corpus fingerprint leaves it out anyway)."""
        return definition_digest(self._definition(framed=False), bos=BOS_ID, eos=EOS_ID, pad=PAD_ID)

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """UTF-8 bytes of ``text`` as ``int32[len(text.encode()) + bos + eos]``, optionally framed by BOS/EOS."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode expects str, got {type(text).__name__}")
        return self.encode_bytes(text.encode("utf-8"), bos=bos, eos=eos)

    def encode_bytes(self, raw: bytes, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """``int32[len(raw) + bos + eos]``: the bytes ``raw`` as they are (valid UTF-8 or not), optionally framed
        by BOS/EOS. ``encode(text)`` is ``encode_bytes(text.encode("utf-8"))``."""
        raw = check_bytes(raw, "ByteTokenizer.encode_bytes")
        prefix = np.array([BOS_ID] if bos else [], np.int32)
        suffix = np.array([EOS_ID] if eos else [], np.int32)
        return np.concatenate([prefix, np.frombuffer(raw, np.uint8), suffix], dtype=np.int32)

    def encode_batch(self, raws: Sequence[bytes], *, bos: bool = True, eos: bool = False) -> list[np.ndarray]:
        """``[encode_bytes(raw, bos=bos, eos=eos) for raw in raws]``."""
        return [self.encode_bytes(raw, bos=bos, eos=eos) for raw in raws]

    def encode_prompt(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
        """``int32[N]``: ``text`` as a model's input, the ids transformers' ``tokenizer(text, add_special_tokens=
        ...).input_ids`` gives on the files :meth:`save` writes: a special token's name in the text (``<|eos|>``)
        is that token, the rest its UTF-8 bytes, after BOS when ``add_special_tokens``."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode_prompt expects str, got {type(text).__name__}")
        specials = self.special_tokens
        ids = [BOS_ID] if add_special_tokens else []
        for piece in split_specials(text, specials):
            ids += [specials[piece]] if piece in specials else list(piece.encode("utf-8"))
        return np.array(ids, np.int32)

    def decode_bytes(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> bytes:
        """Bytes of a 1-D integer sequence in ``[0, VOCAB_SIZE)``: byte tokens as themselves, specials dropped (or,
        with ``skip_special_tokens=False``, written as their names, as transformers' ``decode`` writes them).

        Concatenative: ``decode_bytes(a + b) == decode_bytes(a) + decode_bytes(b)`` (the :class:`BytesDecoder`
        contract that :class:`StreamDecoder` relies on). Raises TokenizerError for another shape, dtype or id.
        """
        ids = ids_array(ids, VOCAB_SIZE)
        if skip_special_tokens:
            return ids[ids < NUM_BYTES].astype(np.uint8).tobytes()
        names = {i: name.encode() for name, i in self.special_tokens.items()}
        return b"".join(bytes([i]) if i < NUM_BYTES else names[i] for i in ids.tolist())

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> str:
        """Text of a 1-D integer sequence in ``[0, VOCAB_SIZE)``; specials are dropped (``skip_special_tokens``) or
        written as their names, invalid UTF-8 is replaced (U+FFFD per maximal invalid subsequence, as
        ``bytes.decode(errors="replace")``). To decode a stream piece by piece, use :class:`StreamDecoder`: decoding
        each piece on its own breaks characters split between pieces."""
        return self.decode_bytes(ids, skip_special_tokens=skip_special_tokens).decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Writes ``tokenizer.json`` (a byte-level BPE without merges: byte ``b`` is id ``b``, written as GPT-2's
        character for it; ``<|pad|>``, ``<|bos|>``, ``<|eos|>`` are the special ids 256, 257, 258; a
        ``TemplateProcessing`` post-processor putting ``<|bos|>`` first) and ``tokenizer_config.json``
        (``add_bos_token: true``) into ``directory``: transformers' ``AutoTokenizer`` loads them and gives the ids of
        :meth:`encode_prompt` (and, with ``add_special_tokens=False``, of :meth:`encode` with ``bos=False``)."""
        config = specials_config(PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, add_bos=True)
        write_files(directory, self._definition(framed=True), config)

    @staticmethod
    def _definition(*, framed: bool) -> str:
        """The byte tokenizer as a Hugging Face ``tokenizer.json`` text (the ``tokenizers`` library's layout), with
        the BOS post-processor (``framed``) or without it (as :meth:`save` wrote it before: what ``digest`` hashes)."""
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
            "post_processor": template_processing([(BOS_TOKEN, BOS_ID)], []) if framed else None,
            "decoder": byte_level,
            "model": model,
        }
        return json.dumps(definition, indent=2, ensure_ascii=False)


def specials_config(
    pad: str | None, bos: str | None, eos: str, *, add_bos: bool = False, add_eos: bool = False
) -> dict[str, Any]:
    """The ``tokenizer_config.json`` we write: transformers' fast tokenizer over ``tokenizer.json`` with these
    specials and no post-processing of the decoded text. ``add_bos_token`` / ``add_eos_token`` repeat what the
    tokenizer.json's post-processor does (transformers 5 reads only the post-processor beside a tokenizer.json;
    transformers 4's Llama-style tokenizer classes rebuild the post-processor from these two keys)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }


def template_processing(prefix: Sequence[tuple[str, int]], suffix: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """A ``tokenizer.json`` ``post_processor`` entry (the ``tokenizers`` library's ``TemplateProcessing``) putting the
    special tokens ``prefix`` ((name, id) pairs) before a text's ids and ``suffix`` after them: what transformers
    adds to ``tokenizer(text)`` (for a pair of texts, the same around each)."""

    def specials(pairs: Sequence[tuple[str, int]], type_id: int) -> list[dict[str, Any]]:
        return [{"SpecialToken": {"id": name, "type_id": type_id}} for name, _ in pairs]

    def sequence(name: str, type_id: int) -> list[dict[str, Any]]:
        return [*specials(prefix, type_id), {"Sequence": {"id": name, "type_id": type_id}}, *specials(suffix, type_id)]

    tokens = {name: {"id": name, "ids": [i], "tokens": [name]} for name, i in [*prefix, *suffix]}
    return {
        "type": "TemplateProcessing",
        "single": sequence("A", 0),
        "pair": [*sequence("A", 0), *sequence("B", 1)],
        "special_tokens": tokens,
    }


def split_specials(text: str, names: Iterable[str]) -> list[str]:
    """``text`` cut at every occurrence of the special tokens' ``names`` (the longest name first where two start at
    one place): the names and the non-empty texts between them, in order."""
    ordered = sorted(names, key=len, reverse=True)
    if not ordered:
        return [text] if text else []
    return [piece for piece in re.split("(" + "|".join(map(re.escape, ordered)) + ")", text) if piece]


def definition_digest(definition: str, *, bos: int | None, eos: int, pad: int | None) -> str:
    """SHA-256 hex of a tokenizer.json text and the special ids that frame and mask a corpus: what fixes the ids of
    a corpus and its loss (other tokenizer_config.json entries, such as a chat template, do not)."""
    h = hashlib.sha256(definition.encode("utf-8"))
    h.update(b"\0" + json.dumps({"bos": bos, "eos": eos, "pad": pad}, sort_keys=True).encode("utf-8"))
    return h.hexdigest()


def write_files(directory: str | os.PathLike[str], definition: str, config: Mapping[str, Any]) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, TOKENIZER_FILE), "w", encoding="utf-8") as f:
        f.write(definition)
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
