"""Tests for core.corpus (corpus loading and splitting), core.data (batching) and the byte tokenizer
(core.byte_tokenizer) the corpus streams by default (tests/test_tokenizer.py covers the tokenizer interface, BPE and
the held-out byte count)."""

import collections
import contextlib
import hashlib
import json
import math
import os
import pathlib
import socket
import sysconfig
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from core import corpus as corpus_lib
from core.byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, ByteTokenizer, TokenizerError
from core.corpus import Corpus, DataError
from core.data import Batches
from core.tokenizer import StreamDecoder

# --------------------------------------------------------------------------- helpers


def split_documents(stream: np.ndarray) -> list[bytes]:
    """Documents of a BOS..EOS stream, checking the framing independently of core.data."""
    stream = np.asarray(stream)
    assert stream.dtype == np.uint16 and stream.ndim == 1
    assert not np.any(stream == PAD_ID) and np.all(stream < VOCAB_SIZE)
    bos = np.flatnonzero(stream == BOS_ID)
    eos = np.flatnonzero(stream == EOS_ID)
    assert len(bos) == len(eos) >= 1
    assert bos[0] == 0 and eos[-1] == len(stream) - 1
    np.testing.assert_array_equal(bos[1:], eos[:-1] + 1)  # ... EOS BOS ... with nothing between.
    assert np.all(eos > bos)
    return [stream[b + 1 : e].astype(np.uint8).tobytes() for b, e in zip(bos, eos)]


def random_text(rng: np.random.Generator, n: int) -> str:
    """Random unicode mixing 1-, 2-, 3- and 4-byte UTF-8 code points (no surrogates)."""
    pools = [(0x20, 0x7F), (0x80, 0x800), (0x800, 0xD800), (0xE000, 0x10000), (0x10000, 0x110000)]
    which = rng.integers(0, len(pools), size=n)
    return "".join(chr(int(rng.integers(*pools[w]))) for w in which)


def write_random_docs(root: pathlib.Path, rng: np.random.Generator, n: int) -> dict[str, bytes]:
    """n random non-empty UTF-8 .txt/.md files in nested directories; returns {relative name: content}."""
    docs = {}
    for i in range(n):
        name = f"d{i % 3}/sub{i % 2}/doc{i:03d}" + (".md" if i % 4 == 0 else ".txt")
        content = random_text(rng, int(rng.integers(1, 60))).encode("utf-8")
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)
        docs[name] = content
    return docs


def random_corpus(rng: np.random.Generator, train_len: int, val_len: int) -> Corpus:
    """A synthetic corpus of random tokens (windows of a few tokens are practically unique)."""
    train = rng.integers(0, VOCAB_SIZE, size=train_len).astype(np.uint16)
    val = rng.integers(0, VOCAB_SIZE, size=val_len).astype(np.uint16)
    return Corpus(train=train, val=val, fingerprint="synthetic", info={})


def is_window_of(row: np.ndarray, stream: np.ndarray) -> bool:
    windows = np.lib.stride_tricks.sliding_window_view(stream.astype(np.int64), len(row))
    return bool((windows == row).all(axis=1).any())


# --------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("bos,eos", [(False, False), (True, False), (False, True), (True, True)])
def test_tokenizer_round_trip(seed, bos, eos):
    rng = np.random.default_rng(seed)
    tok = ByteTokenizer()
    for n in (0, 1, 7, 100):
        text = random_text(rng, n)
        ids = tok.encode(text, bos=bos, eos=eos)
        assert ids.dtype == np.int32 and ids.ndim == 1
        body = ids[int(bos) : len(ids) - int(eos)]
        assert body.tobytes() == np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32).tobytes()
        assert np.count_nonzero(ids == BOS_ID) == bos and (not bos or ids[0] == BOS_ID)
        assert np.count_nonzero(ids == EOS_ID) == eos and (not eos or ids[-1] == EOS_ID)
        assert tok.decode(ids) == text
        assert tok.decode(list(ids)) == text
        # Specials anywhere are dropped.
        noisy = np.insert(ids, rng.integers(0, len(ids) + 1, size=5), rng.integers(256, VOCAB_SIZE, size=5))
        assert tok.decode(noisy) == text


def test_tokenizer_constants_and_errors():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 256, 257, 258)
    assert tok.encode("é", bos=False).tolist() == list("é".encode())
    assert tok.decode([0xC3]) == "\ufffd"  # Truncated multi-byte sequence is replaced.
    assert tok.decode([]) == ""
    with pytest.raises(TokenizerError, match="259"):
        tok.decode([65, 259])
    with pytest.raises(TokenizerError, match="-1"):
        tok.decode([-1])
    with pytest.raises(TokenizerError, match="1-D"):
        tok.decode(np.zeros((2, 2), np.int32))
    not_text: Any = b"abc"  # the wrong type on purpose
    with pytest.raises(TypeError, match="bytes"):
        tok.encode(not_text)


def utf8_reference(ids) -> str:
    """Whole decoding written here, independently of core.tokenizer: drop ids >= 256, replace invalid UTF-8."""
    return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


def noisy_bytes(rng: np.random.Generator) -> bytes:
    """Random text with invalid UTF-8 mixed in: stray continuation and lead bytes, truncated sequences, overlong
    forms, encoded surrogates, code points above U+10FFFF, 0xFF."""
    junk = [
        b"\x80",
        b"\xbf",
        b"\xc3",
        b"\xe2\x82",
        b"\xf0\x9f\x98",
        b"\xc0\x80",
        b"\xed\xa0\x80",
        b"\xf4\x90\x80\x80",
        b"\xff",
    ]
    parts = [random_text(rng, int(rng.integers(0, 6))).encode("utf-8") for _ in range(30)]
    for i in rng.integers(0, len(parts), size=12):
        parts[i] += junk[int(rng.integers(0, len(junk)))]
    return b"".join(parts)


def chunked(ids: np.ndarray, rng: np.random.Generator, max_chunk: int) -> list[np.ndarray]:
    """``ids`` cut into consecutive chunks of random sizes in [1, max_chunk] (1: one id at a time)."""
    cuts = np.cumsum(rng.integers(1, max_chunk + 1, size=len(ids)))
    return np.split(ids, cuts[cuts < len(ids)])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("noisy", [False, True])
def test_stream_decoder_equals_whole_decoding(seed, noisy):
    """Ids fed in random chunks (1 at a time, up to 2 or 9): the pieces concatenate to the whole decoding; a
    character split between chunks is held back, never replaced; every piece extends the text so far; invalid
    bytes become U+FFFD exactly where whole decoding puts them, and a truncated tail at `flush()`."""
    rng = np.random.default_rng(seed)
    tok = ByteTokenizer()
    if noisy:
        raw = noisy_bytes(rng) + b"\xe2\x82"  # ends inside a character: flush() must emit its U+FFFD
        ids = np.concatenate([[BOS_ID], np.frombuffer(raw, np.uint8), [EOS_ID]]).astype(np.int32)
    else:
        text = random_text(rng, 300)
        ids = tok.encode(text, bos=True, eos=True)
    expected = utf8_reference(ids.tolist())
    if not noisy:
        assert expected == text
    else:
        assert "\ufffd" in expected
    for max_chunk in (1, 2, 9):
        decoder = StreamDecoder(tok)
        pieces = []
        for chunk in chunked(ids, rng, max_chunk):
            pieces.append(decoder.feed(chunk if max_chunk > 2 else chunk.tolist()))
            assert expected.startswith("".join(pieces))
        pieces.append(decoder.flush())
        assert "".join(pieces) == expected == tok.decode(ids)
        if not noisy and max_chunk == 1:
            assert "\ufffd" not in "".join(pieces)  # the defect: each step's bytes decoded alone
    # Decoding each chunk on its own (what serve did) is not the same text: the test can see the difference.
    assert "".join(tok.decode(c) for c in chunked(ids, rng, 1)) != expected


def test_stream_decoder_holds_back_a_split_character_and_takes_any_bytes_tokenizer():
    tok = ByteTokenizer()
    euro = list("€".encode())  # 3 bytes
    decoder = StreamDecoder(tok)
    assert [decoder.feed([b]) for b in euro] == ["", "", "€"]
    assert decoder.feed([0xE2]) == "" and decoder.flush() == "\ufffd"  # a truncated tail is replaced at the end
    assert decoder.flush() == ""  # and the decoder starts afresh
    assert decoder.feed([]) == "" and decoder.feed(np.zeros(0, np.int32)) == ""
    with pytest.raises(TokenizerError, match="259"):
        decoder.feed([65, 259])
    assert tok.decode_bytes([BOS_ID, 0xE2, 0x82, EOS_ID, PAD_ID, 0xAC]) == "€".encode()
    assert tok.decode_bytes(np.array([], np.int64)) == b""

    class Pieces:
        """A tokenizer whose tokens are multi-byte pieces that cut characters anywhere (as BPE pieces do)."""

        pieces = (b"ab", b"\xe2", b"\x82\xac", b"\xf0\x9f", b"\x98\x80x", b"\xff", b"")

        def decode_bytes(self, ids):
            return b"".join(self.pieces[i] for i in ids)

    rng = np.random.default_rng(0)
    ids = rng.integers(0, len(Pieces.pieces), size=200)
    expected = b"".join(Pieces.pieces[i] for i in ids).decode("utf-8", errors="replace")
    decoder = StreamDecoder(Pieces())
    assert "".join([decoder.feed(c) for c in chunked(ids, rng, 3)] + [decoder.flush()]) == expected


# --------------------------------------------------------------------------- stdlib corpus


@pytest.fixture(scope="module")
def stdlib_corpus():
    return corpus_lib.load_corpus()


def test_stdlib_files():
    files = corpus_lib.stdlib_files()
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    names = [f.relative_to(root).as_posix() for f in files]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert len(files) > 500
    assert all(f.suffix == ".py" and f.is_file() for f in files)
    assert not any({"site-packages", "dist-packages"} & set(n.split("/")) for n in names)
    assert "os.py" in names and "json/__init__.py" in names


def test_stdlib_corpus(stdlib_corpus):
    corpus = stdlib_corpus
    again = corpus_lib.load_corpus()
    assert corpus.fingerprint == again.fingerprint and len(corpus.fingerprint) == 64
    np.testing.assert_array_equal(corpus.train, again.train)
    np.testing.assert_array_equal(corpus.val, again.val)
    assert not corpus.train.flags.writeable

    files = corpus_lib.stdlib_files()
    train_docs, val_docs = split_documents(corpus.train), split_documents(corpus.val)
    # Every file is exactly one document, wholly on one side.
    contents = collections.Counter(f.read_bytes() for f in files)
    assert collections.Counter(train_docs) + collections.Counter(val_docs) == contents
    assert len(train_docs) + len(val_docs) == len(files)
    assert len(val_docs) == round(0.02 * len(files))
    assert corpus.train.size > 10_000_000 and corpus.val.size > 10_000

    info = json.loads(json.dumps(corpus.info))
    assert info["source"] == "stdlib" and info["python_version"].count(".") == 2
    assert (info["num_train_docs"], info["num_val_docs"]) == (len(train_docs), len(val_docs))
    assert info["train_bytes"] == sum(map(len, train_docs)) and info["val_bytes"] == sum(map(len, val_docs))


# --------------------------------------------------------------------------- user corpus


@pytest.mark.parametrize("n", [2, 3, 10, 51])
@pytest.mark.parametrize("val_fraction", [0.02, 0.25, 0.5])
def test_text_directory_split(tmp_path, n, val_fraction):
    docs = write_random_docs(tmp_path, np.random.default_rng(n), n)
    (tmp_path / "ignored.csv").write_text("a,b")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "skip.txt").write_text("hidden")
    corpus = corpus_lib.load_corpus(str(tmp_path), val_fraction=val_fraction)
    train, val = split_documents(corpus.train), split_documents(corpus.val)
    expected_val = min(max(round(val_fraction * n), 1), n - 1)
    assert len(val) == expected_val and len(train) == n - expected_val
    # Each document is wholly on one side, in sorted-name order on each side.
    ordered = [docs[name] for name in sorted(docs)]
    assert collections.Counter(train) + collections.Counter(val) == collections.Counter(ordered)
    # The documented rule: the held-out names are those with the smallest SHA-256 digests.
    by_digest = sorted(docs, key=lambda name: hashlib.sha256(name.encode()).digest())
    assert sorted(val) == sorted(docs[name] for name in by_digest[:expected_val])
    is_val = [c in val for c in ordered]
    assert [c for c, v in zip(ordered, is_val) if not v] == train
    assert [c for c, v in zip(ordered, is_val) if v] == val
    assert corpus.info["source"] == str(tmp_path)
    # Same directory via a glob pattern and via pathlib.Path: same documents and names, same corpus.
    globbed = corpus_lib.load_corpus(str(tmp_path / "**" / "*.*"), val_fraction=val_fraction)
    assert globbed.fingerprint == corpus.fingerprint
    assert corpus_lib.load_corpus(tmp_path, val_fraction=val_fraction).fingerprint == corpus.fingerprint


def test_split_depends_on_names_not_contents(tmp_path):
    rng = np.random.default_rng(1)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    for i in range(20):
        (a / f"{i}.txt").write_bytes(bytes([65 + i]) * (i + 1))
        (b / f"{i}.txt").write_bytes(rng.bytes(i + 1))

    def side(c):
        return [len(d) for d in split_documents(c.val)]  # Length i + 1 identifies file i.

    load = corpus_lib.load_corpus
    assert side(load(str(a), val_fraction=0.2)) == side(load(str(b), val_fraction=0.2))


def test_fingerprint_sensitivity(tmp_path):
    docs = write_random_docs(tmp_path, np.random.default_rng(2), 8)
    base = corpus_lib.load_corpus(str(tmp_path)).fingerprint
    assert corpus_lib.load_corpus(str(tmp_path)).fingerprint == base
    name = sorted(docs)[5]
    content = bytearray(docs[name])
    content[len(content) // 2] ^= 1
    (tmp_path / name).write_bytes(bytes(content))
    changed = corpus_lib.load_corpus(str(tmp_path)).fingerprint
    assert changed != base
    assert corpus_lib.load_corpus(str(tmp_path), val_fraction=0.5).fingerprint != changed  # The split is hashed too.
    (tmp_path / name).rename(tmp_path / (name + ".txt"))
    assert corpus_lib.load_corpus(str(tmp_path)).fingerprint != changed  # So are names.


def test_jsonl(tmp_path):
    rng = np.random.default_rng(3)
    texts = [random_text(rng, int(rng.integers(0, 40))) for _ in range(30)]
    lines = [json.dumps({"id": i, "body": t}) for i, t in enumerate(texts)]
    lines.insert(7, "   ")  # Blank lines are skipped.
    (tmp_path / "part.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "extra.txt").write_bytes(b"plain \xff bytes")  # Raw bytes, not decoded.
    corpus = corpus_lib.load_corpus(str(tmp_path), val_fraction=0.1, jsonl_field="body")
    train, val = split_documents(corpus.train), split_documents(corpus.val)
    expected = [b"plain \xff bytes"] + [t.encode("utf-8") for t in texts]  # "extra.txt" < "part.jsonl".
    assert len(val) == 3 and len(train) == 28
    assert collections.Counter(train) + collections.Counter(val) == collections.Counter(expected)
    assert corpus.info["num_train_docs"] == 28 and corpus.info["num_val_docs"] == 3


@pytest.mark.parametrize("size", [2, 3, 100, 1001])
@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_single_document_tail_split(tmp_path, size, suffix):
    content = np.random.default_rng(size).integers(32, 127, size=size).astype(np.uint8).tobytes()
    path = tmp_path / f"one{suffix}"
    path.write_bytes(json.dumps({"text": content.decode()}).encode() if suffix == ".jsonl" else content)
    corpus = corpus_lib.load_corpus(str(path), val_fraction=0.1)
    [train], [val] = split_documents(corpus.train), split_documents(corpus.val)
    held = min(max(round(0.1 * size), 1), size - 1)
    assert train == content[: size - held] and val == content[size - held :]
    assert corpus.info["split"] == "tail_bytes"


def error_message(**kwargs) -> str:
    with pytest.raises(DataError) as excinfo:
        corpus_lib.load_corpus(**kwargs)
    return str(excinfo.value)


def test_corpus_errors(tmp_path):
    missing = str(tmp_path / "nope")
    msg = error_message(path=missing)
    assert "data.path" in msg and missing in msg

    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    (empty_dir / "data.csv").write_text("x")
    msg = error_message(path=str(empty_dir))
    assert "data.path" in msg and str(empty_dir) in msg and ".txt" in msg and ".jsonl" in msg
    msg = error_message(path=str(empty_dir / "data.csv"))
    assert "data.path" in msg and "data.csv" in msg and ".txt" in msg
    msg = error_message(path=str(tmp_path / "*.nothing"))
    assert "data.path" in msg and "*.nothing" in msg

    blank = tmp_path / "blank.txt"
    blank.write_bytes(b"")
    msg = error_message(path=str(blank))
    assert "data.path" in msg and "empty" in msg
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"x")
    assert "data.path" in error_message(path=str(tiny))

    for i, (line, field) in enumerate(
        [
            ('{"text": "ok"}\n{"text": oops}', "data.path"),
            ('{"text": "ok"}\n{"text": "\xff"}', "data.path"),
            ('{"text": "ok"}\n[1, 2]', "data.path"),
            ('{"text": "ok"}\n{"body": "no text"}', "data.jsonl_field"),
            ('{"text": "ok"}\n{"text": 42}', "data.jsonl_field"),
            ('{"text": "ok"}\n{"text": "\\ud800"}', "data.jsonl_field"),
        ]
    ):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_bytes(line.encode("latin-1"))  # "\xff" becomes an invalid UTF-8 byte.
        msg = error_message(path=str(bad))
        assert field in msg and f"{bad}:2" in msg, msg
        if field == "data.jsonl_field":
            assert "'text'" in msg

    for value in (0, 0.0, -0.1, 0.51, 1, math.nan, True, "0.1"):
        msg = error_message(path=str(blank), val_fraction=value)
        assert "data.val_fraction" in msg and repr(value) in msg
    for value in ("", 3):
        msg = error_message(path=str(blank), jsonl_field=value)
        assert "data.jsonl_field" in msg and repr(value) in msg


def load_or_unblock(path: str, fifos: Sequence[pathlib.Path], timeout: float = 5.0) -> dict[str, Any]:
    """``{"corpus": ...}`` or ``{"error": ...}`` of ``load_corpus(path)``, run in a thread. If it is still running after
    ``timeout`` seconds (blocked opening a FIFO for reading), each FIFO is opened for writing and closed, which ends
    that read, and the test fails: the defect shows as a failure, never as a hang."""
    result: dict[str, Any] = {}

    def target():
        try:
            result["corpus"] = corpus_lib.load_corpus(path)
        except Exception as e:  # the test inspects whatever it raised
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(timeout)
        pytest.fail(f"load_corpus({path!r}) was still blocked after {timeout} s (it opened a FIFO)")
    return result


def refusal(path: str, fifos: Sequence[pathlib.Path] = ()) -> str:
    result = load_or_unblock(path, fifos)
    assert isinstance(result.get("error"), DataError), result
    return str(result["error"])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs, sockets and symlinks")
def test_special_files_and_broken_symlinks_are_refused_and_symlinked_files_followed(tmp_path):
    """A FIFO with an accepted suffix (in a directory, matched by a glob, named directly), a socket, a symlink to a
    device, a broken symlink and a symlink loop are refused with a DataError naming data.path, the file and why,
    before any file is opened; files without an accepted suffix are ignored whatever they are; a symlink to a regular
    file is followed (its content, under the link's name)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "real.md").write_bytes(b"linked content")
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_bytes(b"plain content")
    (root / "link.txt").symlink_to(outside / "real.md")
    os.mkfifo(root / "ignored.pipe")  # not an accepted suffix: not looked at
    (root / "ignored.csv").symlink_to(tmp_path / "missing.csv")
    corpus = corpus_lib.load_corpus(str(root), val_fraction=0.5)
    docs = split_documents(corpus.train) + split_documents(corpus.val)
    assert sorted(docs) == [b"linked content", b"plain content"]
    named = corpus_lib.load_corpus(str(root / "link.txt"))  # a link named directly: followed too
    assert b"".join(split_documents(named.train) + split_documents(named.val)) == b"linked content"

    fifo = root / "x.txt"
    os.mkfifo(fifo)
    for path in (str(root), str(root / "*.txt"), str(fifo)):
        msg = refusal(path, [fifo])
        assert "data.path" in msg and repr(path) in msg and str(fifo) in msg and "FIFO" in msg, msg
    fifo.unlink()

    cases = {"device.txt": "character device", "broken.txt": "broken symbolic link", "loop.txt": "symbolic link"}
    (root / "device.txt").symlink_to(os.devnull)
    (root / "broken.txt").symlink_to(tmp_path / "gone.txt")
    (root / "loop.txt").symlink_to(root / "loop.txt")
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.bind(str(root / "s.txt"))
            cases["s.txt"] = "socket"
        except OSError:  # a path too long for a socket address: the other cases still run
            pass
        for name, why in cases.items():
            for other in set(cases) - {name}:
                (root / other).rename(tmp_path / other)
            for path in (str(root), str(root / name)):
                msg = refusal(path)
                assert "data.path" in msg and repr(path) in msg and str(root / name) in msg and why in msg, msg
            for other in set(cases) - {name}:
                (tmp_path / other).rename(root / other)
    msg = refusal(str(root / "broken.txt"))
    assert str(tmp_path / "gone.txt") in msg  # where the broken link points


# --------------------------------------------------------------------------- batches


@pytest.mark.parametrize(
    "train_len,seq_len,global_batch", [(300, 1, 1), (300, 7, 12), (1000, 64, 8), (50, 48, 4)]
)  # The last is the ragged edge: only two start offsets.
def test_train_batches(train_len, seq_len, global_batch):
    rng = np.random.default_rng(train_len + seq_len)
    corpus = random_corpus(rng, train_len, 200)

    def make(**kw):
        return Batches(corpus, seq_len=seq_len, global_batch=global_batch, seed=17, **kw)

    run = make()
    batches = [run.train_batch(step) for step in range(6)]
    for batch in batches:
        assert batch.shape == (global_batch, seq_len + 1) and batch.dtype == np.int32
        for row in batch:
            assert is_window_of(row, corpus.train)
    # Deterministic across objects; resuming at step 4 gives the uninterrupted batch.
    for step in (4, 5, 0):
        np.testing.assert_array_equal(make().train_batch(step), batches[step])
    np.testing.assert_array_equal(run.train_batch(np.int64(3)), batches[3])
    if train_len - seq_len > 10:
        assert not np.array_equal(batches[0], batches[1])
        other = Batches(corpus, seq_len=seq_len, global_batch=global_batch, seed=18).train_batch(0)
        assert not np.array_equal(other, batches[0])
    # Process slices are contiguous rows of the global batch.
    for process_count in (2, 4):
        if global_batch % process_count:
            continue
        for step in (0, 5):
            parts = [make(process_index=i, process_count=process_count).train_batch(step) for i in range(process_count)]
            assert all(p.shape == (global_batch // process_count, seq_len + 1) for p in parts)
            np.testing.assert_array_equal(np.concatenate(parts), batches[step])


def test_train_offsets_cover_stream():
    corpus = random_corpus(np.random.default_rng(5), 40, 40)
    batches = Batches(corpus, seq_len=4, global_batch=64, seed=0)
    firsts = np.concatenate([batches.train_batch(s)[:, :2] for s in range(20)])
    starts = {i for i in range(36) for f in firsts if (corpus.train[i : i + 2] == f).all()}
    assert starts == set(range(36))  # Every valid start offset is drawn, including the last.


@pytest.mark.parametrize("val_len,seq_len,global_batch,num_batches", [(200, 7, 4, 3), (97, 3, 4, 6), (96, 3, 4, 6)])
def test_val_batches(val_len, seq_len, global_batch, num_batches):
    corpus = random_corpus(np.random.default_rng(val_len), 300, val_len)
    full = Batches(corpus, seq_len=seq_len, global_batch=global_batch, seed=0)
    batches = full.val_batches(num_batches)
    assert len(batches) == num_batches
    assert all(b.shape == (global_batch, seq_len + 1) and b.dtype == np.int32 for b in batches)
    for a, b in zip(batches, full.val_batches(num_batches)):
        np.testing.assert_array_equal(a, b)
    rows = np.concatenate(batches)
    stride = val_len // len(rows)
    for w, row in enumerate(rows):  # Non-overlapping, evenly spaced windows of the val stream.
        np.testing.assert_array_equal(row, corpus.val[w * stride : w * stride + seq_len + 1])
    assert stride >= seq_len + 1
    for process_count in (2, 4):
        parts = [
            Batches(
                corpus, seq_len=seq_len, global_batch=global_batch, seed=0, process_index=i, process_count=process_count
            ).val_batches(num_batches)
            for i in range(process_count)
        ]
        for n in range(num_batches):
            np.testing.assert_array_equal(np.concatenate([p[n] for p in parts]), batches[n])


def batches_error(corpus, **kwargs) -> str:
    kwargs = {"seq_len": 8, "global_batch": 4, "seed": 0} | kwargs
    with pytest.raises(DataError) as excinfo:
        Batches(corpus, **kwargs)
    return str(excinfo.value)


def test_batches_errors():
    corpus = random_corpus(np.random.default_rng(0), 100, 30)
    msg = batches_error(corpus, global_batch=6, process_count=4)
    assert "data.batch_size" in msg and "6" in msg and "4" in msg
    msg = batches_error(corpus, seq_len=29)  # val has 30 tokens: needs > seq_len + 1.
    assert "data.seq_len=29" in msg and "30" in msg and "val" in msg
    msg = batches_error(corpus, seq_len=99)
    assert "data.seq_len=99" in msg and "100" in msg and "train" in msg
    Batches(corpus, seq_len=28, global_batch=4, seed=0)  # Largest valid seq_len.
    cases: list[tuple[dict[str, Any], str]] = [
        ({"seq_len": 0}, "data.seq_len"),
        ({"global_batch": 0}, "data.batch_size"),
        ({"seed": -1}, "data.seed"),
        ({"seq_len": 2.0}, "data.seq_len"),
        ({"process_index": 2, "process_count": 2}, "process_index"),
    ]
    for kwargs, field in cases:
        assert field in batches_error(corpus, **kwargs)

    ok = Batches(corpus, seq_len=4, global_batch=2, seed=0)
    ok.val_batches(3)  # 6 windows of 5 tokens == 30 tokens: fits exactly.
    with pytest.raises(DataError) as excinfo:
        ok.val_batches(4)
    assert "train.eval_batches=4" in str(excinfo.value) and "30" in str(excinfo.value)
    with pytest.raises(DataError, match="step"):
        ok.train_batch(-1)


def test_stdlib_batches(stdlib_corpus):
    batches = Batches(stdlib_corpus, seq_len=256, global_batch=8, seed=3)
    batch = batches.train_batch(123)
    starts = np.random.Generator(np.random.PCG64([3, 123])).integers(0, stdlib_corpus.train.size - 256, size=8)
    for start, row in zip(starts, batch):  # The documented offset draw, checked with a plain slice.
        np.testing.assert_array_equal(row, stdlib_corpus.train[start : start + 257])
    assert ByteTokenizer().decode(batch[0])  # Decodes to text.
