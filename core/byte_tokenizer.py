"""The byte tokenizer (the default, ``data.tokenizer = "bytes"``) and what every tokenizer shares: the special
tokens' ids and names, GPT-2's byte-level alphabet, the error type, the checks of ids and bytes, and the
``tokenizer.json`` + ``tokenizer_config.json`` files both write (core.tokenizer is the interface)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
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
        return definition_digest(self._definition(), bos=BOS_ID, eos=EOS_ID, pad=PAD_ID)

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

    def decode_bytes(self, ids: Sequence[int] | np.ndarray) -> bytes:
        """Bytes of a 1-D integer sequence in ``[0, VOCAB_SIZE)``: byte tokens as themselves, specials dropped.

        Concatenative: ``decode_bytes(a + b) == decode_bytes(a) + decode_bytes(b)`` (the :class:`BytesDecoder`
        contract that :class:`StreamDecoder` relies on). Raises TokenizerError for another shape, dtype or id.
        """
        ids = ids_array(ids, VOCAB_SIZE)
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
        write_files(directory, self._definition(), specials_config(PAD_TOKEN, BOS_TOKEN, EOS_TOKEN))

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


def specials_config(pad: str | None, bos: str | None, eos: str) -> dict[str, Any]:
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
