"""The corpus: documents read from files (or the Python standard library), a held-out split, tokenisation
(core.tokenizer) into two flat token streams.

A corpus is two flat token streams, ``train`` and ``val``, where every document is written as
``BOS + ids + EOS`` (BOS only if the tokenizer has one): with the default byte tokenizer, ``ids`` are the
document's bytes and the streams are ``uint16``; with a Hugging Face tokenizer (``data.tokenizer``) they are
its ids, ``uint16`` while ``vocab_size <= 65536`` and ``uint32`` past that (core.data batches them). Everything is
NumPy.

Split rule (documents never straddle train and val)
    With ``n >= 2`` documents, ``k = min(max(round(val_fraction * n), 1), n - 1)``
    documents are held out: those whose names have the ``k`` smallest SHA-256 digests
    (ties by position). A document's side depends only on the set of names, never on
    contents. Names are relative POSIX paths of files, and ``"<file>:<line>"`` (1-based)
    for JSONL records. A corpus of a single document is split inside it instead: the
    last ``min(max(round(val_fraction * L), 1), L - 1)`` of its ``L`` bytes are held out
    and each side is written as its own ``BOS ... EOS`` document. The split is made on
    bytes, before tokenisation, so it is the same for every tokenizer.

Errors in user input raise :class:`DataError` naming the config field (``data.path``,
``data.jsonl_field``, ...), the offending value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import pathlib
import platform
import stat
import struct
import sysconfig
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from core.byte_tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from core.tokenizer import Tokenizer

__all__ = [
    "ACCEPTED_SUFFIXES",
    "Corpus",
    "CorpusRecord",
    "DataError",
    "Documents",
    "describe_corpus",
    "load_corpus",
    "load_documents",
    "stdlib_files",
]

TEXT_SUFFIXES = (".md", ".py", ".text", ".txt")  # One file is one document.
JSONL_SUFFIXES = (".jsonl",)  # One document per line, from a string field.
ACCEPTED_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES
_GLOB_CHARS = frozenset("*?[")
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

Document = tuple[str, bytes]  # (relative name, content)


class DataError(ValueError):
    """Invalid data input: a bad config value, an unreadable corpus or a too-short stream."""


# --------------------------------------------------------------------------- corpus


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """A tokenized corpus split into train and held-out documents.

    Attributes:
      train: ``uint16[T]`` (``uint32[T]`` for a tokenizer of more than 65,536 ids) read-only token stream,
        ``BOS + ids + EOS`` per train document (no BOS if the tokenizer has none).
      val: the held-out documents' stream, same layout and dtype.
      fingerprint: SHA-256 hex digest of every document's (name, content) in order and the split, and of the
        tokenizer's ``digest`` unless it is the byte tokenizer (whose fingerprints are those of the bytes alone).
      info: JSON-serialisable summary: ``source`` ("stdlib" or the path), ``python_version``
        (stdlib only), ``split`` ("documents" or "tail_bytes"), ``val_fraction``,
        ``num_train_docs``, ``num_val_docs``, ``train_bytes``, ``val_bytes`` (the documents' bytes, specials
        excluded), and for a Hugging Face tokenizer ``tokenizer`` (its vocab_size and digest).
      tokenizer: the tokenizer of the streams (default the byte tokenizer).
    """

    train: np.ndarray
    val: np.ndarray
    fingerprint: str
    info: dict[str, Any]
    tokenizer: Tokenizer = dataclasses.field(default_factory=ByteTokenizer)

    def __post_init__(self):
        dtype = _stream_dtype(self.tokenizer.vocab_size)
        for name in ("train", "val"):
            stream = getattr(self, name)
            if not isinstance(stream, np.ndarray) or stream.ndim != 1 or stream.dtype != dtype:
                raise DataError(
                    f"Corpus.{name} must be a 1-D {dtype.name} array (a tokenizer of {self.tokenizer.vocab_size} ids), "
                    f"got {_describe(stream)}"
                )


class Documents(NamedTuple):
    """A corpus before tokenisation (:func:`load_documents`): the train and held-out documents' bytes in order,
    the fingerprint of names, contents and split, and the ``info`` of :class:`Corpus` (without the tokenizer)."""

    train: list[bytes]
    val: list[bytes]
    fingerprint: str
    info: dict[str, Any]


def _stream_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def stdlib_files() -> list[pathlib.Path]:
    """Absolute paths of the ``*.py`` files of the running Python's standard library.

    The root is ``sysconfig.get_paths()["stdlib"]``; ``site-packages``, ``dist-packages`` and
    ``__pycache__`` directories are skipped. Sorted by relative POSIX path, so the list is
    deterministic for a given Python installation.
    """
    root = _stdlib_root()
    files: list[pathlib.Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        files.extend(pathlib.Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(
    path: str | os.PathLike[str] | None = None,
    *,
    val_fraction: float = 0.02,
    jsonl_field: str = "text",
    tokenizer: Tokenizer | None = None,
) -> Corpus:
    """Loads, splits and tokenizes a corpus (see the module docstring for the split rule).

    Args:
      path, val_fraction, jsonl_field: the documents, as :func:`load_documents`.
      tokenizer: ``None`` or a :class:`core.tokenizer.ByteTokenizer` for bytes; else any
        :class:`core.tokenizer.Tokenizer`, which encodes every document at once (``encode_batch``; a Hugging Face
        tokenizer reads a document that is not valid UTF-8 with ``errors="replace"``: U+FFFD for its invalid bytes).

    Returns:
      A :class:`Corpus`: ``BOS + ids + EOS`` per document (BOS only if the tokenizer has one), ``uint16`` streams
      (``uint32`` past 65,536 ids); the fingerprint is :func:`load_documents`' for the byte tokenizer, else
      ``sha256(f"{documents_fingerprint}:tokenizer:{tokenizer.digest}")``.

    Raises:
      DataError: naming ``data.path``, ``data.val_fraction`` or ``data.jsonl_field``.
    """
    docs = load_documents(path, val_fraction=val_fraction, jsonl_field=jsonl_field)
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    fingerprint, info = _described(docs, tokenizer)
    if isinstance(tokenizer, ByteTokenizer):
        return Corpus(_byte_stream(docs.train), _byte_stream(docs.val), fingerprint, info, tokenizer)
    train, val = (_token_stream(tokenizer, contents) for contents in (docs.train, docs.val))
    return Corpus(train, val, fingerprint, info, tokenizer)


class CorpusRecord(NamedTuple):
    """A corpus's `fingerprint` and `info`, as :class:`Corpus` holds them, without its token streams."""

    fingerprint: str
    info: dict[str, Any]


def describe_corpus(
    path: str | os.PathLike | None = None,
    *,
    val_fraction: float = 0.02,
    jsonl_field: str = "text",
    tokenizer: Tokenizer | None = None,
) -> CorpusRecord:
    """What :func:`load_corpus` would record of the corpus (its fingerprint and info, equal to the loaded
    corpus's), from the documents alone: nothing is tokenized. Raises DataError as :func:`load_corpus` does."""
    docs = load_documents(path, val_fraction=val_fraction, jsonl_field=jsonl_field)
    return CorpusRecord(*_described(docs, ByteTokenizer() if tokenizer is None else tokenizer))


def _described(docs: Documents, tokenizer: Tokenizer) -> tuple[str, dict[str, Any]]:
    """(fingerprint, info) of `docs` tokenized by `tokenizer` (the byte tokenizer's: the documents' own)."""
    if isinstance(tokenizer, ByteTokenizer):
        return docs.fingerprint, docs.info
    fingerprint = hashlib.sha256(f"{docs.fingerprint}:tokenizer:{tokenizer.digest}".encode()).hexdigest()
    return fingerprint, {**docs.info, "tokenizer": {"vocab_size": tokenizer.vocab_size, "digest": tokenizer.digest}}


def load_documents(
    path: str | os.PathLike[str] | None = None, *, val_fraction: float = 0.02, jsonl_field: str = "text"
) -> Documents:
    """Loads and splits a corpus's documents (see the module docstring for the split rule), untokenized.

    Args:
      path: ``None`` for the built-in corpus (:func:`stdlib_files`, one document per file).
        Otherwise a file, a directory (searched recursively, skipping names that start with
        ``"."``) or a glob pattern (``**`` allowed; matched directories are searched as above).
        Only regular files are read: symbolic links to regular files are followed, while FIFOs, sockets,
        devices and broken symbolic links with an accepted suffix are refused (DataError) before any file is
        opened. Directories and globs use only files with an accepted suffix (case-insensitive):
        ``.md .py .text .txt`` are read as raw bytes, one document per file; ``.jsonl`` has one
        JSON object per line and the document is its string field ``jsonl_field`` encoded as
        UTF-8 (blank lines are skipped). A file named directly must have an accepted suffix.
      val_fraction: Fraction of documents (or of bytes, for a single document) held out, in ``(0, 0.5]``.
      jsonl_field: Name of the string field holding the text of a JSONL record.

    Returns:
      :class:`Documents`: train and held-out contents, their fingerprint and the corpus ``info``.

    Raises:
      DataError: naming ``data.path``, ``data.val_fraction`` or ``data.jsonl_field``.
    """
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction <= 0.5:
        raise DataError(f"data.val_fraction={val_fraction!r} must be a number in (0, 0.5]")
    if not isinstance(jsonl_field, str) or not jsonl_field:
        raise DataError(f"data.jsonl_field={jsonl_field!r} must be a non-empty string")
    if path is None:
        root = _stdlib_root()
        docs = [(p.relative_to(root).as_posix(), p.read_bytes()) for p in stdlib_files()]
        info = {"source": "stdlib", "python_version": platform.python_version()}
    else:
        source = os.fspath(path)
        docs = [
            doc for name, file in _resolve_files(source) for doc in _read_documents(source, name, file, jsonl_field)
        ]
        info = {"source": source}
    return _split(docs, float(val_fraction), info)


def _stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _resolve_files(source: str) -> list[tuple[str, pathlib.Path]]:
    """(relative POSIX name, path) of every corpus file named by ``source``, sorted by name.

    Only regular files are corpus files. A symbolic link to a regular file is followed (its content is read under
    the link's own name); a symbolic link to a directory inside a searched directory is not descended into
    (``os.walk``'s default), one named by ``source`` or matched by a glob is. Every file with an accepted suffix is
    checked with ``os.stat`` before any file is opened: a FIFO, socket or device (directly or through a link), a
    broken symbolic link or a link loop raises DataError naming ``data.path``, the file and why (reading a FIFO
    would wait forever for a writer). Files without an accepted suffix are ignored, whatever they are.
    """
    path = pathlib.Path(source)
    if path.is_dir():
        root, candidates = path, _walk(path)
    elif os.path.lexists(path):  # a file named directly: regular, a link (perhaps broken) or a special file
        if path.suffix.lower() not in ACCEPTED_SUFFIXES:
            raise DataError(f"data.path={source!r} has suffix {path.suffix!r}; accepted: {' '.join(ACCEPTED_SUFFIXES)}")
        _check_regular(source, path)
        return [(path.name, path)]
    elif _GLOB_CHARS & set(source):
        root = pathlib.Path(*_take_literal(pathlib.PurePath(source).parts))
        matches = [pathlib.Path(m) for m in glob.glob(source, recursive=True)]
        candidates = [f for m in matches for f in (_walk(m) if m.is_dir() else [m])]
    else:
        raise DataError(f"data.path={source!r} does not exist; expected a file, a directory or a glob pattern")
    named = {f.relative_to(root).as_posix(): f for f in candidates if f.suffix.lower() in ACCEPTED_SUFFIXES}
    if not named:
        accepted = " ".join(ACCEPTED_SUFFIXES)
        raise DataError(f"data.path={source!r} contains no usable files; accepted suffixes: {accepted}")
    files = sorted(named.items())
    for _, file in files:
        _check_regular(source, file)
    return files


_NOT_REGULAR = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def _not_regular(source: str, path: pathlib.Path, mode: int) -> DataError:
    """The DataError for ``path`` whose (followed) ``st_mode`` is not a regular file's."""
    kind = next((name for test, name in _NOT_REGULAR if test(mode)), f"a special file (mode {stat.filemode(mode)})")
    via = " (through a symbolic link)" if os.path.islink(path) else ""
    return DataError(
        f"data.path={source!r}: {path} is {kind}{via}, not a regular file; a corpus file must be a regular file or a "
        "symbolic link to one"
    )


def _check_regular(source: str, path: pathlib.Path) -> None:
    """Raises DataError naming ``data.path``, ``path`` and why, unless ``path`` is a regular file or a symbolic
    link (chain) to one. Opens nothing: ``os.stat`` only."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if os.path.islink(path):
            if isinstance(e, FileNotFoundError):
                raise DataError(
                    f"data.path={source!r}: {path} is a broken symbolic link -> {os.readlink(path)} (which does not "
                    "exist); a corpus file must be a regular file or a symbolic link to one"
                ) from None
            raise DataError(
                f"data.path={source!r}: {path} is a symbolic link that cannot be followed ({e.strerror})"
            ) from None
        raise DataError(f"data.path={source!r}: {path} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise _not_regular(source, path, mode)


def _read_regular(source: str, path: pathlib.Path) -> bytes:
    """The content of ``path``, which must still be a regular file: opened without blocking (``O_NONBLOCK``, so that
    a FIFO put in its place after :func:`_check_regular` cannot hang the open) and checked again with ``fstat``
    before it is read. I/O errors become DataError naming ``data.path`` and the file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise DataError(f"data.path={source!r}: {path} cannot be opened ({e.strerror})") from None
    with open(fd, "rb", closefd=True) as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(source, path, mode)
        try:
            return f.read()
        except OSError as e:
            raise DataError(f"data.path={source!r}: {path} cannot be read ({e.strerror})") from None


def _take_literal(parts: Sequence[str]) -> list[str]:
    """Leading path components without glob characters."""
    literal = []
    for part in parts:
        if _GLOB_CHARS & set(part):
            break
        literal.append(part)
    return literal


def _walk(root: pathlib.Path) -> list[pathlib.Path]:
    """Every non-directory entry under ``root`` (files, symbolic links to files, broken links and special files,
    which :func:`_check_regular` refuses when their suffix is accepted), skipping names that start with ``"."``;
    symbolic links to directories are listed by ``os.walk`` as directories and not descended into."""
    files: list[pathlib.Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        files.extend(pathlib.Path(dirpath, f) for f in filenames if not f.startswith("."))
    return files


def _read_documents(source: str, name: str, path: pathlib.Path, field: str) -> list[Document]:
    """Documents of one file of ``data.path = source``: the whole file for text suffixes, one per non-blank line for
    JSONL. The file is read only if it is (still) a regular file (:func:`_read_regular`)."""
    content = _read_regular(source, path)
    if path.suffix.lower() not in JSONL_SUFFIXES:
        return [(name, content)]
    docs = []
    for lineno, line in enumerate(content.split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"data.path: {where} is not valid UTF-8 (byte {e.start} of the line)") from None
        except json.JSONDecodeError as e:
            raise DataError(f"data.path: {where} is not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"data.path: {where} holds a JSON {type(record).__name__}; expected an object")
        if field not in record:
            raise DataError(f"data.jsonl_field={field!r} is missing at {where}; keys there: {sorted(record)[:10]}")
        text = record[field]
        if not isinstance(text, str):
            raise DataError(f"data.jsonl_field={field!r} at {where} is a {type(text).__name__}; expected a string")
        try:
            docs.append((f"{name}:{lineno}", text.encode("utf-8")))
        except UnicodeEncodeError as e:
            raise DataError(f"data.jsonl_field={field!r} at {where} is not encodable as UTF-8 ({e})") from None
    return docs


def _split(docs: list[Document], val_fraction: float, info: dict[str, Any]) -> Documents:
    """Splits ``docs`` (see module docstring) and fingerprints the result."""
    if not any(content for _, content in docs):
        raise DataError(f"data.path={info['source']!r} gives an empty corpus ({len(docs)} documents, 0 bytes)")
    digest = hashlib.sha256()
    for name, content in docs:
        for part in (os.fsencode(name), content):
            digest.update(struct.pack("<Q", len(part)))
            digest.update(part)
    if len(docs) == 1:
        [(_, content)] = docs
        if len(content) < 2:
            raise DataError(f"data.path={info['source']!r} is a single document of 1 byte; it cannot be split")
        cut = len(content) - _held_out_count(val_fraction, len(content))
        train_docs, val_docs = [content[:cut]], [content[cut:]]
        digest.update(b"split:tail_bytes:%d" % cut)
        split = {"split": "tail_bytes", "num_train_docs": 1, "num_val_docs": 1}
    else:
        held = _held_out_mask([name for name, _ in docs], val_fraction)
        train_docs = [content for (_, content), h in zip(docs, held) if not h]
        val_docs = [content for (_, content), h in zip(docs, held) if h]
        digest.update(b"split:documents:" + np.flatnonzero(held).astype("<i8").tobytes())
        split = {"split": "documents", "num_train_docs": len(train_docs), "num_val_docs": len(val_docs)}
    info = {
        **info,
        **split,
        "val_fraction": val_fraction,
        "train_bytes": sum(map(len, train_docs)),
        "val_bytes": sum(map(len, val_docs)),
    }
    return Documents(train_docs, val_docs, digest.hexdigest(), info)


def _held_out_count(val_fraction: float, n: int) -> int:
    """``round(val_fraction * n)`` (half to even) clamped to ``[1, n - 1]``, for ``n >= 2``."""
    return min(max(round(val_fraction * n), 1), n - 1)


def _held_out_mask(names: Sequence[str], val_fraction: float) -> np.ndarray:
    """``bool[len(names)]``: True for the documents whose names have the smallest SHA-256 digests."""
    keys = [hashlib.sha256(os.fsencode(name)).digest() for name in names]
    order = sorted(range(len(names)), key=lambda i: (keys[i], i))
    mask = np.zeros(len(names), bool)
    mask[order[: _held_out_count(val_fraction, len(names))]] = True
    return mask


def _byte_stream(contents: Sequence[bytes]) -> np.ndarray:
    """Read-only ``uint16[sum(len) + 2 * len(contents)]``: ``BOS + bytes + EOS`` per document (byte tokenizer)."""
    bos, eos = np.array([BOS_ID], np.uint16), np.array([EOS_ID], np.uint16)
    parts = [part for content in contents for part in (bos, np.frombuffer(content, np.uint8), eos)]
    stream = np.concatenate(parts, dtype=np.uint16) if parts else np.zeros(0, np.uint16)
    stream.flags.writeable = False
    return stream


def _token_stream(tokenizer: Tokenizer, contents: Sequence[bytes]) -> np.ndarray:
    """Read-only stream of ``[bos] + ids + [eos]`` per document in the tokenizer's stream dtype."""
    parts = tokenizer.encode_batch(contents, bos=True, eos=True)
    dtype = _stream_dtype(tokenizer.vocab_size)
    stream = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
    stream.flags.writeable = False
    return stream


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"array of shape {x.shape} dtype {x.dtype}"
    return type(x).__name__
