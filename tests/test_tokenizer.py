"""core.tokenizer (bytes and byte-level BPE behind one interface), its use by the data, the held-out byte count,
the config key data.tokenizer, and `python -m experiments.tokenizer train`.

The BPE is the committed fixture tests/fixtures/hf/tokenizer (320 ids, trained by our trainer; made by
tests/fixtures/hf/make_tokenizer_fixture.py, which also recorded transformers' ids for it). Nothing here compiles a
model; the byte count runs under jax.jit on its own."""

import hashlib
import json
import os
import pathlib
import struct
import types
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from core import config as config_lib
from core import corpus as corpus_lib
from core import schema as core_schema
from core import tokenizer as tokenizer_lib
from core.byte_tokenizer import ByteTokenizer, TokenizerError
from core.fields import ConfigError
from core.hf_tokenizer import HFTokenizer
from core.tokenizer import StreamDecoder
from core.train import count_target_bytes
from experiments import build
from experiments import tokenizer as tokenizer_cli
from experiments.hf import generation
from kvcache.serving import EngineConfig

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
BPE_DIR = FIXTURES / "tokenizer"
REFERENCE = json.loads((FIXTURES / "tokenizer_reference.json").read_text(encoding="utf-8"))
BYTE_DIGEST = "20ddaed2700d5a2462d26cd231f5340aa2d8245c4acd1e62fe94a49f4c7fb619"  # before save() wrote a post-processor


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return HFTokenizer.from_file(BPE_DIR)


@pytest.fixture(params=["bytes", "bpe"])
def tok(request, bpe):
    return ByteTokenizer() if request.param == "bytes" else bpe


def random_text(rng: np.random.Generator, n: int) -> str:
    """n random characters: ASCII words and code punctuation mixed with 2-, 3- and 4-byte characters."""
    pools = ["abcdefghij klmnop\n    ():=_'", "éèàüßñç", "日本語中文東京", "😀🎉🚀", "☃♥€"]
    which = rng.choice(len(pools), size=n, p=[0.6, 0.1, 0.1, 0.1, 0.1])
    return "".join(rng.choice(list(pools[w])) for w in which)


def write_corpus(root: pathlib.Path, rng: np.random.Generator, n: int) -> dict[str, bytes]:
    docs = {}
    for i in range(n):
        content = random_text(rng, int(rng.integers(1, 80))).encode()
        (root / f"doc{i:02d}.txt").write_bytes(content)
        docs[f"doc{i:02d}.txt"] = content
    return docs


# --------------------------------------------------------------------------- the interface, both tokenizers


def test_the_byte_tokenizer_has_the_byte_ids():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 256, 257, 258)
    assert tok.special_ids == (256, 257, 258) and tok.never_sampled == (256, 257)
    np.testing.assert_array_equal(tok.byte_lengths, [1] * 256 + [0] * 3)


def test_the_trained_bpe_has_its_specials_first(bpe):
    """Our trainer's layout: <|pad|>, <|bos|>, <|eos|> = 0, 1, 2 (no tokenizer_config.json needed to find them)."""
    assert (bpe.vocab_size, bpe.pad_id, bpe.bos_id, bpe.eos_id) == (320, 0, 1, 2)
    assert bpe.special_ids == (0, 1, 2) and bpe.never_sampled == (0, 1)
    assert bpe.byte_lengths.dtype == np.int32 and bpe.byte_lengths.shape == (320,)
    assert bpe.byte_lengths[:3].tolist() == [0, 0, 0] and bpe.byte_lengths[3:259].tolist() == [1] * 256
    assert bpe.byte_lengths[259:].min() >= 2  # every merge is at least two bytes
    assert bpe.decode_bytes([0, 1, 2]) == b"" and sorted(bpe.decode_bytes(range(3, 259))) == list(range(256))


@pytest.mark.parametrize("seed", range(3))
def test_encode_decode_round_trip_and_byte_lengths(tok, seed):
    """decode(encode(t)) == t; BOS / EOS framing; sum(byte_lengths[ids]) == len(t.encode()); a special's name in the
    text is text, not the special."""
    rng = np.random.default_rng(seed)
    for n in (0, 1, 9, 200):
        text = random_text(rng, n) + ("<|eos|>" if n == 9 else "")
        for bos, eos in ((False, False), (True, True)):
            ids = tok.encode(text, bos=bos, eos=eos)
            assert ids.dtype == np.int32 and ids.ndim == 1
            assert not bos or ids[0] == tok.bos_id
            assert not eos or ids[-1] == tok.eos_id
            assert np.count_nonzero(np.isin(ids, tok.special_ids)) == bos + eos
            assert tok.decode(ids) == text and tok.decode(list(ids)) == text
            assert int(tok.byte_lengths[ids].sum()) == len(text.encode())
        np.testing.assert_array_equal(tok.encode_bytes(text.encode(), bos=False), tok.encode(text, bos=False))


def test_decode_errors_name_the_id(tok):
    with pytest.raises(TokenizerError, match=str(tok.vocab_size)):
        tok.decode([3, tok.vocab_size])
    with pytest.raises(TokenizerError, match="-1"):
        tok.decode([-1])
    with pytest.raises(TokenizerError, match="1-D"):
        tok.decode(np.zeros((2, 2), np.int32))
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"abc")


@pytest.mark.parametrize("seed", range(2))
def test_bpe_pieces_cut_characters_and_the_stream_decoder_joins_them(bpe, seed):
    """BPE ids whose bytes end inside a character (b"r\\xc3", b"\\xe3\\x81"): decode_bytes is concatenative, and
    StreamDecoder fed one id (or a few) at a time gives the whole text, while decoding each id alone does not."""
    rng = np.random.default_rng(seed)
    text = random_text(rng, 300) + "crème brûlée 日本語のテキストです 😀"
    ids = bpe.encode(text, bos=True, eos=True)
    pieces = [bpe.decode_bytes([i]) for i in ids.tolist()]
    assert b"".join(pieces) == bpe.decode_bytes(ids) == text.encode()
    torn = [p for p in pieces if p and p != p.decode("utf-8", errors="ignore").encode()]
    assert torn, "no id of the text cuts a character: the test would show nothing"
    for chunk in (1, 3):
        decoder = StreamDecoder(bpe)
        out = []
        for start in range(0, len(ids), chunk):
            out.append(decoder.feed(ids[start : start + chunk]))
            assert text.startswith("".join(out))
        assert "".join(out) + decoder.flush() == text
    assert "".join(bpe.decode([i]) for i in ids.tolist()) != text


# --------------------------------------------------------------------------- data


@pytest.mark.parametrize("name", ["bytes", "bpe"])
def test_the_held_out_split_round_trips_and_counts_its_bytes(tmp_path, bpe, name):
    """The whole held-out stream of a small corpus decodes to its documents, each framed BOS ... EOS; the bytes its
    ids stand for are the documents' bytes; the split is the same for both tokenizers (made on bytes)."""
    tok = ByteTokenizer() if name == "bytes" else bpe
    write_corpus(tmp_path, np.random.default_rng(5), 24)
    corpus = corpus_lib.load_corpus(tmp_path, val_fraction=0.25, tokenizer=tok)
    docs = corpus_lib.load_documents(tmp_path, val_fraction=0.25)
    assert corpus.tokenizer is tok and corpus.val.dtype == np.uint16 and not corpus.val.flags.writeable
    for stream, contents in ((corpus.val, docs.val), (corpus.train, docs.train)):
        starts = np.flatnonzero(stream == tok.bos_id)
        ends = np.flatnonzero(stream == tok.eos_id)
        assert len(starts) == len(ends) == len(contents) and starts[0] == 0 and ends[-1] == len(stream) - 1
        assert [tok.decode_bytes(stream[s + 1 : e]) for s, e in zip(starts, ends)] == contents
        assert int(tok.byte_lengths[stream].sum()) == sum(map(len, contents))
    assert len(docs.val) == 6 and corpus.info["val_bytes"] == sum(map(len, docs.val))
    if name == "bpe":
        assert len(corpus.train) < sum(map(len, docs.train))  # merges compress even this random text


def old_fingerprint(root: pathlib.Path, val_fraction: float) -> str:
    """The corpus fingerprint as the byte-level code computed it before tokenizers existed, written out here: SHA-256
    over (length-prefixed name, content) of every file in name order, then the held-out positions (the k names of
    smallest SHA-256)."""
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.txt"))
    h = hashlib.sha256()
    for name in files:
        for part in (name.encode(), (root / name).read_bytes()):
            h.update(struct.pack("<Q", len(part)) + part)
    k = min(max(round(val_fraction * len(files)), 1), len(files) - 1)
    held = sorted(sorted(range(len(files)), key=lambda i: (hashlib.sha256(files[i].encode()).digest(), i))[:k])
    h.update(b"split:documents:" + np.asarray(held, "<i8").tobytes())
    return h.hexdigest()


def test_the_byte_fingerprint_is_unchanged_and_a_bpe_one_holds_its_digest(tmp_path, bpe):
    """Existing byte-level runs still resume: the byte tokenizer's fingerprint is the old formula's; a BPE's is
    sha256(old:tokenizer:digest), and its info names the tokenizer."""
    write_corpus(tmp_path, np.random.default_rng(7), 9)
    old = old_fingerprint(tmp_path, 0.3)
    assert corpus_lib.load_corpus(tmp_path, val_fraction=0.3).fingerprint == old
    assert corpus_lib.load_corpus(tmp_path, val_fraction=0.3, tokenizer=ByteTokenizer()).fingerprint == old
    corpus = corpus_lib.load_corpus(tmp_path, val_fraction=0.3, tokenizer=bpe)
    assert corpus.fingerprint == hashlib.sha256(f"{old}:tokenizer:{bpe.digest}".encode()).hexdigest()
    assert corpus.info["tokenizer"] == {"vocab_size": 320, "digest": bpe.digest}


def test_a_large_vocabulary_streams_uint32(tmp_path, bpe):
    """Past 65,536 ids the streams are uint32; Corpus refuses a dtype that does not fit its tokenizer."""
    big = types.SimpleNamespace(
        vocab_size=70_000,
        bos_id=None,
        eos_id=69_999,
        digest="d",
        encode_batch=lambda raws, bos, eos: [np.array([1, 69_998][: len(r) % 3] + [69_999], np.int32) for r in raws],
    )
    (tmp_path / "a.txt").write_bytes(b"abcd")
    (tmp_path / "b.txt").write_bytes(b"ef")
    corpus = corpus_lib.load_corpus(tmp_path, val_fraction=0.5, tokenizer=big)
    assert corpus.train.dtype == corpus.val.dtype == np.uint32 and 69_999 in corpus.train
    with pytest.raises(corpus_lib.DataError, match="uint16"):
        corpus_lib.Corpus(np.zeros(4, np.uint32), np.zeros(4, np.uint32), "f", {}, bpe)


@pytest.mark.parametrize("name", ["bytes", "bpe"])
def test_the_eval_byte_count_is_the_bytes_of_the_decoded_targets(bpe, name):
    """core.train.count_target_bytes (what make_eval_step reports as "bytes") under jit equals the UTF-8 length of
    the non-pad targets decoded, for random ids of every kind, several shapes, and pad_id None counts them all."""
    tok = ByteTokenizer() if name == "bytes" else bpe
    count = jax.jit(count_target_bytes, static_argnames="pad_id")
    rng = np.random.default_rng(0)
    for shape in [(5,), (3, 7), (2, 4, 9)]:
        targets = rng.integers(0, tok.vocab_size, size=shape)
        targets.flat[::3] = tok.pad_id
        kept = targets[targets != tok.pad_id]
        expected = len(tok.decode_bytes(kept))
        assert expected > 0
        assert int(count(jnp.asarray(targets), tok.byte_lengths, pad_id=tok.pad_id)) == expected
        assert int(count(jnp.asarray(targets), tok.byte_lengths, pad_id=None)) == expected  # pad is 0 bytes


# --------------------------------------------------------------------------- files: transformers and refusals


@pytest.mark.parametrize("name", ["bpe", "bytes"])
def test_transformers_gives_our_ids(bpe, name):
    """The fixture: transformers (PreTrainedTokenizerFast and AutoTokenizer) on the files our save() wrote gave
    these ids, decodes and special ids; ours give the same: `encode` without BOS is its add_special_tokens=False,
    and `encode_prompt` is its `tokenizer(text)`: BOS first (the post-processor save() writes), a special's name in
    the text that special. The byte tokenizer's digest is what it was before its files carried the BOS rule."""
    tok = bpe if name == "bpe" else ByteTokenizer()
    ref = REFERENCE[name]
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (
        ref["bos_token_id"],
        ref["eos_token_id"],
        ref["pad_token_id"],
        ref["vocab_size"],
    )
    assert len(ref["cases"]) >= 10 and any(ord(c) > 0xFFFF for case in ref["cases"] for c in case["text"])
    for case in ref["cases"]:
        assert tok.encode(case["text"], bos=False).tolist() == case["ids"], case["text"]
        assert tok.encode_prompt(case["text"]).tolist() == case["prompt_ids"] == [tok.bos_id, *case["ids"]]
        assert tok.decode(case["ids"]) == case["decoded"] == case["text"]
    for case in ref["prompts"]:  # special names inside the text
        assert tok.encode_prompt(case["text"]).tolist() == case["prompt_ids"], case["text"]
        assert tok.encode_prompt(case["text"], add_special_tokens=False).tolist() == case["prompt_ids"][1:]
    if name == "bytes":
        assert tok.digest == ref["digest"] == BYTE_DIGEST  # corpora fingerprinted before keep their fingerprint


def test_old_tokenizer_files_keep_their_digest_and_frame_as_transformers_reads_them(tmp_path):
    """tokenizer_legacy/ is the fixture BPE as save() wrote it before (no post-processor, add_bos_token false): it
    loads with the digest it had (so its corpora keep their fingerprints) and frames prompts as transformers reads
    those files (no BOS); a run trained here with it frames with BOS, as its corpus did
    (experiments.hf.generation.run_tokenizer), and its save() writes that for transformers."""
    old = HFTokenizer.from_file(FIXTURES / "tokenizer_legacy")
    assert old.digest == "23c5a3f99ec99f863794e7bc845bcb7987081f4f4f2de8d8d5299940aa56d2f0" and old.framing == ((), ())
    for case in REFERENCE["legacy_bpe"]["prompts"]:
        assert old.encode_prompt(case["text"]).tolist() == case["prompt_ids"], case["text"]
    config = ml_collections.ConfigDict({"data": {"tokenizer": str(FIXTURES / "tokenizer_legacy")}})
    config.checkpoint = {"init_from": ""}
    ours = generation.run_tokenizer(config)
    assert ours.framing == ((1,), ()) and ours.digest == old.digest
    for case in REFERENCE["bpe"]["prompts"]:  # the same ids transformers gives on the files save() writes now
        assert ours.encode_prompt(case["text"]).tolist() == case["prompt_ids"], case["text"]
    ours.save(tmp_path)
    assert HFTokenizer.from_file(tmp_path).framing == ((1,), ())
    config.checkpoint.init_from = "hf:somewhere"  # an imported checkpoint frames as its own files say
    assert generation.run_tokenizer(config).framing == ((), ())
    for case in REFERENCE["legacy_bytes"]["prompts"]:  # the byte tokenizer's old files: transformers added no BOS
        assert ByteTokenizer().encode_prompt(case["text"], add_special_tokens=False).tolist() == case["prompt_ids"]


def test_saved_files_load_back_as_the_same_tokenizer(tmp_path, bpe):
    """The byte tokenizer saved is a BPE without merges giving the byte ids; an HFTokenizer saved and reloaded
    keeps its digest and ids."""
    ByteTokenizer().save(tmp_path / "bytes")
    as_bpe = tokenizer_lib.load(str(tmp_path / "bytes"))
    assert isinstance(as_bpe, HFTokenizer)
    assert (as_bpe.vocab_size, as_bpe.pad_id, as_bpe.bos_id, as_bpe.eos_id) == (259, 256, 257, 258)
    np.testing.assert_array_equal(as_bpe.byte_lengths, ByteTokenizer().byte_lengths)
    text = random_text(np.random.default_rng(1), 100)
    np.testing.assert_array_equal(as_bpe.encode(text, eos=True), ByteTokenizer().encode(text, eos=True))
    np.testing.assert_array_equal(
        as_bpe.encode_prompt(text + "<|eos|>"), ByteTokenizer().encode_prompt(text + "<|eos|>")
    )
    bpe.save(tmp_path / "again")
    again = tokenizer_lib.load(str(tmp_path / "again" / "tokenizer.json"))
    assert again.digest == bpe.digest and again.framing == bpe.framing == ((1,), ())
    np.testing.assert_array_equal(again.encode(text), bpe.encode(text))


def non_byte_level(kind: str) -> str:
    """A small tokenizer.json that is not a byte-level BPE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "ab": 3}
    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
        tok.decoder = decoders.WordPiece()
    elif kind == "unigram":
        tok = Tokenizer(models.Unigram([("[UNK]", 0.0), ("a", -1.0), ("b", -1.0)], 0))
        tok.decoder = decoders.Metaspace()
    else:  # SentencePiece-style BPE: Metaspace, no byte-level characters
        tok = Tokenizer(models.BPE(vocab, [("a", "b")], unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
    return tok.to_str()


@pytest.mark.parametrize(
    "kind, needles",
    [
        ("wordpiece", ["model.type", "'WordPiece'"]),
        ("unigram", ["model.type", "'Unigram'"]),
        ("metaspace", ["decoder"]),
    ],
)
def test_a_tokenizer_that_is_not_byte_level_is_refused_by_file_and_field(tmp_path, kind, needles):
    path = tmp_path / "tokenizer.json"
    path.write_text(non_byte_level(kind))
    with pytest.raises(TokenizerError) as e:
        tokenizer_lib.load(str(tmp_path))
    for needle in [*needles, str(path), "data.tokenizer", "byte-level BPE"]:
        assert needle in str(e.value), (needle, str(e.value))


def test_bad_tokenizer_files_and_configs_are_refused_by_name(tmp_path, bpe):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notjson.json").write_text("{not json")
    cases = [
        ("", ["data.tokenizer", "'bytes'"]),
        (str(tmp_path / "nope"), ["data.tokenizer", "does not exist"]),
        (str(tmp_path / "empty"), ["data.tokenizer", "without a tokenizer.json"]),
        (str(tmp_path / "notjson.json"), ["data.tokenizer", "notjson.json", "is not JSON", "line 1"]),
    ]
    bpe.save(tmp_path / "badeos")
    (tmp_path / "badeos" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    cases.append((str(tmp_path / "badeos"), ["tokenizer_config.json", "eos_token", "'</s>'", "not in the vocabulary"]))
    bpe.save(tmp_path / "noeos")
    (tmp_path / "noeos" / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    cases.append((str(tmp_path / "noeos"), ["no end-of-sequence token", "eos_token"]))
    for spec, needles in cases:
        with pytest.raises(TokenizerError) as e:
            tokenizer_lib.load(spec)
        for needle in needles:
            assert needle in str(e.value), (needle, str(e.value))


def test_a_configured_pad_that_is_eos_is_no_pad(tmp_path, bpe):
    """tokenizer_config.json names the specials (strings or {"content"} dicts); a pad that is also EOS gives pad_id
    None, so the loss does not mask the documents' ends; the config is saved again as it was."""
    bpe.save(tmp_path)
    config = {"bos_token": None, "eos_token": {"content": "<|bos|>"}, "pad_token": "<|bos|>", "chat_template": "x"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = tokenizer_lib.load(str(tmp_path))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, 1, None)
    assert tok.encode("ab", bos=True, eos=True).tolist() == [*bpe.encode("ab", bos=False), 1]
    tok.save(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text()) == config


# --------------------------------------------------------------------------- config, engine


def test_data_tokenizer_is_checked_early_and_is_provenance(tmp_path):
    """data.tokenizer: a wrong type, a missing path and a model too small for the tokenizer fail validation with
    ConfigErrors naming the keys; it is a provenance key (a resume refuses its change)."""
    base = core_schema.defaults()
    assert base.data.tokenizer == "bytes"
    assert core_schema.provenance(base, config_lib.SECTIONS)["data.tokenizer"] == "bytes"
    for value, needles in [
        (3, ["data.tokenizer", "3", "str"]),
        (str(tmp_path / "missing"), ["data.tokenizer", "missing", "does not exist"]),
    ]:
        d = base.to_dict()
        d["data"]["tokenizer"] = value
        config = ml_collections.ConfigDict(d)
        with pytest.raises(ConfigError) as e:
            core_schema.validate(config)
        assert all(n in str(e.value) for n in needles), str(e.value)
    config = ml_collections.ConfigDict(base.to_dict())
    config.data.tokenizer = str(BPE_DIR)
    config.model.vocab_size = 300
    with pytest.raises(ConfigError) as e:
        core_schema.validate(config)
    assert all(n in str(e.value) for n in ["model.vocab_size", "300", "data.tokenizer", "320"]), str(e.value)
    config.model.vocab_size = 320
    core_schema.validate(config)
    assert isinstance(build.build_tokenizer(config), HFTokenizer)


def test_the_engine_config_takes_the_tokenizers_ids(bpe):
    """The special ids are the tokenizer's, given or read by `for_tokenizer`; none defaults to a particular
    tokenizer's (a config without them is refused); ids that contradict each other are refused by name."""
    ids: dict[str, Any] = dict(eos_id=2, never=(0, 1), num_ids=320)
    config = EngineConfig(memory_bytes=1 << 20, **ids)
    assert (config.eos_id, config.never, config.num_ids) == (2, (0, 1), 320)
    from_bpe = EngineConfig.for_tokenizer(bpe, memory_bytes=1)
    assert (from_bpe.eos_id, from_bpe.never, from_bpe.num_ids) == (bpe.eos_id, tuple(bpe.never_sampled), 320)
    from_bytes = EngineConfig.for_tokenizer(ByteTokenizer(), memory_bytes=1)
    assert (from_bytes.eos_id, from_bytes.never, from_bytes.num_ids) == (258, (256, 257), 259)
    for missing in ("eos_id", "never", "num_ids"):
        with pytest.raises(ValueError, match=f"needs the tokenizer's special ids; missing \\['{missing}'\\]"):
            EngineConfig(memory_bytes=1 << 20, **{k: v for k, v in ids.items() if k != missing})
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(eos_id=1, never=(0, 1)), "eos_id = 1 can never be sampled"),
        (dict(eos_id=400, num_ids=320), "eos_id = 400 can never be sampled"),
        (dict(eos_id=-1), "eos_id = -1"),
        (dict(never=(0, -2)), "never holds -2"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError, match=needle):
            EngineConfig(memory_bytes=1 << 20, **{**ids, **kwargs})


# --------------------------------------------------------------------------- python -m experiments.tokenizer


def test_train_cli_trains_on_the_train_split_only(tmp_path, capsys):
    """A word that only held-out documents hold is never merged; the written files load as a 300-id BPE with the
    specials 0, 1, 2, and the output reports held-out bytes per token."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(corpus, np.random.default_rng(3), 20)
    held = corpus_lib.load_documents(corpus, val_fraction=0.2)
    names = sorted(p.name for p in corpus.iterdir())
    for name in names:
        content = (corpus / name).read_bytes()
        if content in held.val:
            (corpus / name).write_bytes(content + b" qzxqzx qzxqzx qzxqzx" * 20)
    out = tmp_path / "tok"
    args = ["train", "--vocab-size", "300", "--out", str(out), "--data-path", str(corpus), "--val-fraction", "0.2"]
    assert tokenizer_cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "16 train documents" in printed and "4 held out" in printed and "bytes per token" in printed, printed
    tok = tokenizer_lib.load(str(out))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size <= 300 and tok.special_ids == (0, 1, 2)
    assert sorted(os.listdir(out)) == ["tokenizer.json", "tokenizer_config.json"]
    assert tok.vocab_size > 259  # it merged something
    assert not any(b"qz" in tok.decode_bytes([i]) or b"zx" in tok.decode_bytes([i]) for i in range(tok.vocab_size))
    assert b"qz" not in b"".join(held.train)


@pytest.mark.parametrize(
    "args, needles",
    [
        (["train", "--vocab-size", "100", "--out", "x"], ["--vocab-size", "'100'", "integer >= 259"]),
        (["train", "--vocab-size", "3e2", "--out", "x"], ["--vocab-size", "'3e2'"]),
        (["train", "--vocab-size", "300"], ["--out", "required"]),
        (["train", "--vocab-size", "300", "--out", "x", "--val-fraction", "0.7"], ["--val-fraction", "0.7", "0.5"]),
        (["train", "--vocab-size", "300", "--out", "x", "--val-fraction", "0"], ["--val-fraction", "> 0"]),
        (["fit", "--vocab-size", "300"], ["invalid choice", "'fit'", "train"]),
    ],
)
def test_train_cli_bad_flags_exit_2_naming_the_flag(capsys, args, needles):
    with pytest.raises(SystemExit) as e:
        tokenizer_cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error:" in err and all(n in err for n in needles), err


def test_train_cli_a_corpus_it_cannot_read_is_an_error_line(tmp_path, capsys):
    code = tokenizer_cli.main(["train", "--vocab-size", "300", "--out", str(tmp_path / "o"), "--data-path", "/nope"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: data.path='/nope'") and not (tmp_path / "o").exists(), err


def test_train_cli_help_shows_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as e:
        tokenizer_cli.main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    for flag, default in [("--data-path", ""), ("--jsonl-field", "text"), ("--val-fraction", "0.02")]:
        assert flag in out and f"(default: {default})" in out, (flag, out)
    assert "--vocab-size" in out and "--out" in out and "default: None" not in out


# --------------------------------------------------------------------------- against transformers itself


@pytest.mark.hf
@pytest.mark.parametrize("name", ["bpe", "bytes"])
def test_transformers_recomputes_the_fixture(tmp_path, bpe, name):
    """With transformers installed: its fast tokenizer and AutoTokenizer, loading the files our save() writes now,
    give our ids and decodes for the fixture's texts."""
    transformers = pytest.importorskip("transformers")
    tok = bpe if name == "bpe" else ByteTokenizer()
    tok.save(tmp_path)
    for loaded in (
        transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path)),
        transformers.AutoTokenizer.from_pretrained(str(tmp_path)),
    ):
        assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
        for case in REFERENCE[name]["cases"] + REFERENCE[name]["prompts"]:
            ids = loaded(case["text"])["input_ids"]
            assert ids == tok.encode_prompt(case["text"]).tolist(), case["text"]
            assert loaded.decode(ids, skip_special_tokens=True) == tok.decode(ids)
