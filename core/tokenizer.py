"""Tokenizers: bytes (the default) or a Hugging Face ``tokenizer.json``, one interface for data and decoding.

Two implementations of one interface (:class:`Tokenizer`), each in its own module (their names are imported from
there; this module holds the interface, :func:`load` and :class:`StreamDecoder`):

* :class:`ByteTokenizer` (core.byte_tokenizer, ``data.tokenizer = "bytes"``): ids ``0 .. 255`` are the byte
  values, then PAD (256), BOS (257), EOS (258); ``vocab_size`` 259. Embedded, nothing to load.
* :class:`HFTokenizer` (core.hf_tokenizer, ``data.tokenizer = path``): a byte-level BPE ``tokenizer.json`` (model
  type ``BPE`` with a ``ByteLevel`` decoder and pre-tokenizer, as GPT-2, Llama 3, Qwen2 / Qwen3 and ``python -m
  experiments.tokenizer train`` use), run by the ``tokenizers`` library (an optional dependency, the
  ``[experiments]`` extra, imported only when one is loaded). Its BOS / EOS / PAD are named by
  ``tokenizer_config.json`` beside it (``bos_token`` / ``eos_token`` / ``pad_token``: strings or ``{"content":
  ...}`` dicts), else they are the tokens our trainer writes, ``<|bos|>`` / ``<|eos|>`` / ``<|pad|>``, where the
  vocabulary has them. Other models (SentencePiece / Metaspace, WordPiece, Unigram, BPE with byte fallback) are
  refused: their pieces are not bytes, so neither exact streaming detokenisation nor bits per byte would hold.

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
* ``encode_prompt`` is how a prompt is read, the ids of transformers' ``tokenizer(text).input_ids`` for the files
  ``save`` writes: a special token's name in the text is that token (as transformers and vLLM read a prompt), and
  ``framing`` (the BOS / EOS ids around a prompt) is what the tokenizer's own post-processor adds (Llama 3:
  ``<|begin_of_text|>``; Qwen: nothing; the byte tokenizer and our trainer's BPEs: BOS, as every document of their
  corpora begins). ``encode_prompt(text, add_special_tokens=False)`` leaves the framing out (a chat template writes
  its own, as transformers' ``apply_chat_template`` tokenizes).
* ``save(directory)`` writes ``tokenizer.json`` + ``tokenizer_config.json`` that transformers'
  ``PreTrainedTokenizerFast`` / ``AutoTokenizer`` loads and that give ``encode_prompt``'s ids (the byte tokenizer's
  is a BPE with no merges over the 256 byte-level characters, the specials at 256 .. 258, BOS put first by a
  ``TemplateProcessing`` post-processor).

Errors in user input raise :class:`TokenizerError` naming ``data.tokenizer`` or the file and field at fault, the
value and what is supported.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from core.byte_tokenizer import TOKENIZER_FILE, ByteTokenizer, TokenizerError
from core.hf_tokenizer import HFTokenizer

__all__ = ["BytesDecoder", "StreamDecoder", "Tokenizer", "load"]


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
      never_sampled: ids generation must never produce: PAD, BOS and ids no token uses (a generation config's end
        ids are sampled even so: the engine and core.generate take them out).
      framing: (prefix ids, suffix ids) ``encode_prompt`` puts around a prompt's text.
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
    @property
    def framing(self) -> tuple[tuple[int, ...], tuple[int, ...]]: ...

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """``int32[N]``: ``text``'s ids, after BOS (when ``bos`` and the tokenizer has one), then EOS if ``eos``."""
        ...

    def encode_bytes(self, raw: bytes, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """``int32[N]``: ``encode`` of bytes (for an :class:`HFTokenizer` decoded as UTF-8, invalid bytes as U+FFFD)."""
        ...

    def encode_batch(self, raws: Sequence[bytes], *, bos: bool = True, eos: bool = False) -> list[np.ndarray]:
        """``[encode_bytes(raw) for raw in raws]``, computed in one batch (in parallel for an HFTokenizer)."""
        ...

    def encode_prompt(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
        """``int32[N]``: transformers' ``tokenizer(text, add_special_tokens=...).input_ids`` for the files ``save``
        writes: special tokens' names in ``text`` are those tokens; ``framing`` around it if ``add_special_tokens``."""
        ...

    def decode_bytes(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> bytes:
        """Concatenative bytes of 1-D integer ids in ``[0, vocab_size)``; specials give ``b""`` (their names with
        ``skip_special_tokens=False``)."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> str:
        """``decode_bytes(ids, skip_special_tokens=...).decode("utf-8", errors="replace")``."""
        ...

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Writes ``tokenizer.json`` + ``tokenizer_config.json`` into ``directory`` (created if missing)."""
        ...


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
    elif not os.path.exists(spec):
        raise TokenizerError(f"data.tokenizer={spec!r} does not exist; allowed: {allowed}")
    elif not os.path.isfile(spec):
        raise TokenizerError(
            f"data.tokenizer={spec!r} is not a regular file (a FIFO, a device or a socket); allowed: {allowed}"
        )
    try:
        return HFTokenizer.from_file(spec)
    except TokenizerError as e:
        raise TokenizerError(f"data.tokenizer={spec!r}: {e}") from None


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
      skip_special_tokens: False: special tokens are written as their names (the tokenizer's ``decode_bytes`` must
        then take ``skip_special_tokens``, as ``ByteTokenizer`` and ``HFTokenizer`` do); True: they are dropped.
    """

    def __init__(self, tokenizer: BytesDecoder, *, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text completed by ``ids`` (1-D integer ids, possibly empty; errors as ``tokenizer.decode_bytes``)."""
        if self.skip_special_tokens:
            return self._utf8.decode(self.tokenizer.decode_bytes(ids))
        return self._utf8.decode(self.tokenizer.decode_bytes(ids, skip_special_tokens=False))  # type: ignore[call-arg]

    def flush(self) -> str:
        """The held-back end of the stream (``""``, or U+FFFD for a truncated character); the decoder is reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
