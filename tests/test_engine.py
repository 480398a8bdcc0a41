"""The serving engine: equal to isolated generation under interleaving, chunking, prefix hits, eviction and
preemption; the block manager's reference counts and LRU; admission control; metrics from timestamps."""

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core import generate as generate_lib
from core import sampling
from core.byte_tokenizer import ByteTokenizer
from core.model import Transformer, TransformerConfig
from kvcache import capacity, formats, paged_cache_factory
from kvcache.serving import BlockManager, Engine, EngineConfig, Request, SamplingParams, block_hashes

CFG = TransformerConfig(
    vocab_size=264, d_model=128, num_layers=2, num_heads=2, num_kv_heads=1, d_ff=96, init_std=0.3
)  # large weights: varied greedy continuations
BS = 16
IDS: dict[str, Any] = dict(eos_id=258, never=(256, 257), num_ids=259)  # the byte tokenizer's, as `isolated` generates


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


WIDTH, NEW = 80, 16  # the longest prompt and the most new tokens any test asks `isolated` for


def isolated(model, fmt, prompt, n):
    """Greedy generation of one prompt through the paged cache of the same format, by `core.generate`. The prompt
    is batched with a filler prompt of WIDTH tokens and continued by NEW tokens (the first n kept: greedy), so every
    call of a format is one compiled program; rows of a batch never attend to each other."""
    assert len(prompt) <= WIDTH and n <= NEW, (len(prompt), n)
    factory = paged_cache_factory(fmt, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim)
    batch = [np.asarray(prompt), np.ones(WIDTH, np.int32)]
    out = generate_lib.generate(
        model, batch, max_new_tokens=NEW, key=jax.random.key(0), cache_factory=factory, tokenizer=ByteTokenizer()
    )
    out = out[0, :n].tolist()
    return out[: out.index(256)] if 256 in out else out  # PAD after EOS


def engine(model, fmt, blocks, **kw):
    shape = capacity.ModelShape(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim)
    per_block = capacity.block_bytes(shape, fmt, block_size=BS)
    return Engine(
        model,
        fmt,
        EngineConfig.for_tokenizer(
            ByteTokenizer(),
            memory_bytes=blocks * per_block,
            block_size=BS,
            max_model_len=256,
            **{"max_num_batched_tokens": 32, **kw},
        ),
    )


def prompts_with_shared_prefix(seed=0):
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 256, 2 * BS + 5).tolist()
    return [shared + rng.integers(0, 256, n).tolist() for n in (3, 30, 11)] + [rng.integers(0, 256, 7).tolist()]


@pytest.mark.parametrize("name", ["bf16", "fp4", "nvfp4", "k8v4"])
def test_interleaved_requests_equal_isolated_generation(model, name):
    """Four requests (shared prefix, lengths 7..67) with a 32-token budget: chunked prefills interleave with
    decodes of other requests, and every output equals the request's isolated greedy generation."""
    fmt = formats.get(name)
    eng = engine(model, fmt, blocks=64, max_num_seqs=3)
    prompts = prompts_with_shared_prefix()
    requests = [eng.submit(p, 10) for p in prompts]
    eng.run()
    for prompt, request in zip(prompts, requests):
        assert request.output == isolated(model, fmt, prompt, 10), request.id
    assert eng.stats["steps"] > 10  # it did interleave
    assert eng.blocks.num_available == eng.pool.num_blocks  # everything released


def test_prefix_cache_hits_reuse_blocks(model):
    """A second request sharing 2 full blocks with a finished one starts from them (the same block ids), computes
    only the rest, and still generates what it would alone."""
    fmt = formats.get("fp4")
    eng = engine(model, fmt, blocks=64)
    first, second = prompts_with_shared_prefix()[:2]
    a = eng.submit(first, 4)
    eng.run()
    hashes = block_hashes(first, BS)
    cached = [eng.blocks._block_of[h] for h in hashes]
    b = eng.submit(second, 6)
    eng.step()
    assert b.cached_tokens == 2 * BS and b.blocks[:2] == cached
    assert all(eng.blocks.refs(blk) == 1 for blk in cached)
    eng.run()
    assert b.output == isolated(model, fmt, second, 6) and a.output == isolated(model, fmt, first, 4)
    assert eng.stats["cached_tokens"] == 2 * BS


def test_eviction_and_preemption_keep_outputs_exact(model):
    """A pool of 9 blocks (144 tokens) for requests of up to 83 tokens: cached blocks get evicted and running
    sequences preempted; outputs still equal isolated generation, and a request whose prefix was evicted finds
    fewer cached tokens (evicted blocks are never read)."""
    fmt = formats.get("bf16")
    eng = engine(model, fmt, blocks=9, max_num_seqs=4)
    prompts = prompts_with_shared_prefix(seed=1)
    requests = [eng.submit(p, 16) for p in prompts]
    eng.run()
    for prompt, request in zip(prompts, requests):
        assert request.output == isolated(model, fmt, prompt, 16), request.id
    assert eng.stats["preemptions"] > 0
    # Fill the pool with unrelated requests: the shared prefix's blocks are evicted.
    rng = np.random.default_rng(5)
    for _ in range(3):
        eng.submit(rng.integers(0, 256, 60).tolist(), 4)
        eng.run()
    again = eng.submit(prompts[1], 3)
    eng.run()
    assert again.cached_tokens < 2 * BS
    assert again.output == isolated(model, fmt, prompts[1], 3)


def test_request_larger_than_the_pool_is_rejected(model):
    fmt = formats.get("fp4")
    eng = engine(model, fmt, blocks=4)  # 64 tokens
    ok = eng.submit(list(range(20)), 5)
    with pytest.raises(ValueError, match="needs 5 blocks; the KV pool has 4"):
        eng.submit(list(range(70)), 5)
    with pytest.raises(ValueError, match="exceeds max_model_len = 256"):
        eng.submit(list(range(250)), 10)
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        eng.submit([1, 2], 0)
    eng.run()
    assert ok.output == isolated(model, fmt, list(range(20)), 5)
    with pytest.raises(ValueError, match="max_model_len = 64 must be >= 2 x"):
        EngineConfig(memory_bytes=1 << 20, max_model_len=64, max_num_batched_tokens=64, **IDS)


@pytest.mark.parametrize(
    "prompt, position, shown",
    [
        ([5, -1], 1, "-1"),
        ([10**6], 0, "1000000"),
        ([1, 2, CFG.vocab_size], 2, str(CFG.vocab_size)),  # one past the model's last id
        ([7, 3.7], 1, "3.7"),  # int() would truncate it to 3
        ([True, 2], 0, "True"),  # a bool is not a token id
        (np.array([1.0, 2.0]), 0, "1.0"),  # float dtype, even when whole
        ([4, np.float32(2)], 1, "2.0"),
        ([4, "5"], 1, "'5'"),
        ([4, None], 1, "None"),
        (np.array([[1, 2]]), 0, "[1, 2]"),  # a row, not an id
        ([0, np.uint64(2**64 - 1)], 1, str(2**64 - 1)),
        ([np.int64(-(2**63))], 0, str(-(2**63))),
    ],
)
def test_submit_refuses_token_ids_outside_the_vocabulary(model, prompt, position, shown):
    """Every prompt id must be an integer (Python or NumPy, not bool, not float) in [0, model vocab size = 264): a
    ValueError names the first bad position, its value and the range, and changes nothing (queue, next id)."""
    eng = engine(model, formats.get("bf16"), blocks=4)
    first = eng.submit([1, 2, 3], 2)
    with pytest.raises(ValueError) as excinfo:
        eng.submit(prompt, 2)
    msg = str(excinfo.value)
    assert f"position {position}" in msg and shown in msg and f"[0, {CFG.vocab_size})" in msg, msg
    assert list(eng.waiting) == [first] and not eng.running
    assert eng.submit([CFG.vocab_size - 1, 0], 2).id == first.id + 1  # the refused request took no id


def test_submit_accepts_integer_ids_of_any_kind(model):
    eng = engine(model, formats.get("bf16"), blocks=4)
    for prompt in ([0, CFG.vocab_size - 1], np.array([3, 4], np.int32), np.array([3, 4], np.uint8), [np.int64(9)]):
        request = eng.submit(prompt, 2)
        assert request.prompt == [int(t) for t in prompt] and all(type(t) is int for t in request.prompt)


def test_block_manager_refcounts_and_lru():
    blocks = BlockManager(4, 2)
    a = blocks.allocate(2)
    assert a is not None
    for blk, h in zip(a, block_hashes([1, 2, 3, 4], 2)):
        blocks.register(blk, h)
    blocks.release(a)  # cached, the tail (a[1]) first in line for eviction
    assert blocks.num_available == 4
    assert blocks.match([1, 2, 3, 4, 5]) == a and blocks.refs(a[0]) == 1
    blocks.release(a)
    assert blocks.match([1, 2, 9, 9]) == a[:1]  # a different second block: only the first matches
    b = blocks.allocate(3)  # 2 free + evicts a[1], never a[0] (referenced)
    assert b is not None and a[1] in b and a[0] not in b
    assert blocks.match([1, 2, 3, 4]) == a[:1]  # the evicted second block is gone from the cache
    assert blocks.allocate(1) is None  # nothing left: no change
    with pytest.raises(ValueError, match="released more often"):
        blocks.release(a[1:] * 3)


def test_metrics_from_timestamps():
    r = Request(0, [1, 2], 3, arrival=10.0)
    r.first_token_time, r.token_times, r.finish_time, r.output = 10.5, [10.5, 10.7, 11.1], 11.1, [5, 6, 7]
    assert r.ttft == pytest.approx(0.5) and r.tpot == pytest.approx(0.3)


def test_engine_records_consistent_times(model):
    fmt = formats.get("fp8")
    eng = engine(model, fmt, blocks=32)
    requests = [eng.submit(p, 5) for p in prompts_with_shared_prefix()[:3]]
    eng.run()
    for r in requests:
        assert r.arrival <= r.first_token_time == r.token_times[0] <= r.finish_time == r.token_times[-1]
        assert len(r.token_times) == len(r.output) and np.all(np.diff(r.token_times) > 0)
        assert r.ttft > 0 and r.tpot == pytest.approx((r.finish_time - r.first_token_time) / (len(r.output) - 1))


@pytest.mark.parametrize("masked", [False, True])
def test_no_request_compiles_after_warmup(model, masked):
    """`Engine.warmup` compiles the very programs the steps run (the pool as a step returns it, the same argument
    kinds): the requests after it, prefills and decodes of every bucket the budget allows, compile nothing; with
    `masked`, requests with a repetition penalty and min_tokens neither."""
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))  # committed, as a loaded checkpoint is
    eng = engine(model, formats.get("bf16"), blocks=32)
    eng.warmup(masked=masked)
    params = SamplingParams(repetition_penalty=1.2, min_tokens=2) if masked else None
    compiled = []

    class Compiles(logging.Handler):
        def emit(self, record):
            compiled.append(record.getMessage())

    handler = Compiles()
    logging.getLogger("jax").addHandler(handler)
    try:
        with jax.log_compiles(True):
            for p in prompts_with_shared_prefix()[:3]:
                eng.submit(p, 4, sampling=params)
            eng.run()
    finally:
        logging.getLogger("jax").removeHandler(handler)
    assert eng.stats["steps"] > 3
    assert not [m for m in compiled if m.startswith("Compiling")], compiled


def _reference_probs(logits, allowed, temperature, top_k, top_p, min_p=0.0):
    """float64, as HF / vLLM: softmax(logits / T) over the allowed ids, less the ids below min_p x the most likely's
    probability, cut to the top_k most likely and renormalised, then cut to the smallest set of the most likely
    whose mass reaches top_p, renormalised."""
    z = np.where(allowed, logits.astype(np.float64), -np.inf) / temperature
    p = np.exp(z - z.max())
    z[p < min_p] = -np.inf  # (p / max p = p here)
    order = np.argsort(-z, kind="stable")
    z[order[top_k:]] = -np.inf
    p = np.exp(z - z.max())
    p /= p.sum()
    mass, keep = 0.0, np.zeros(len(p), bool)
    for i in order:
        if mass >= top_p or p[i] == 0:
            break
        keep[i], mass = True, mass + p[i]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 0.8, 0.0), (5, 1.0, 0.0), (6, 0.7, 0.0), (0, 1.0, 0.05)])
def test_sampling_follows_temperature_min_p_top_k_and_top_p(model, top_k, top_p, min_p):
    """4000 draws of `_sample` (the engine's on-device sampler, as a step draws: the seeded request's keys for its
    tokens 0..3999) on fixed logits: the ids drawn lie in the float64 reference's support and their frequencies
    are within 4 standard errors of its probabilities; the recorded log-probabilities are the float64 log-softmax
    over the sampleable ids (before temperature and cuts), and the top alternatives are the best ids."""
    eng = engine(model, formats.get("bf16"), blocks=4)
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, CFG.vocab_size).astype(np.float32)
    logits[[256, 257]] += 20  # never sampled (PAD, BOS) however likely
    params = SamplingParams(
        temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p, seed=9, logprobs=True, top_logprobs=3
    )
    request = Request(0, [1], 4000, 0.0, sampling=params)
    draws = np.array(eng._sample(logits, request, 4000))  # tokens 0..3999: each the next key of its stream
    assert request.output == list(draws)
    allowed = np.arange(CFG.vocab_size) < 259
    allowed[[256, 257]] = False
    want = _reference_probs(logits, allowed, 0.7, top_k or CFG.vocab_size, top_p, min_p)
    assert min_p == 0 or 3 < np.count_nonzero(want) < 259 - 3  # the min_p cut keeps some and cuts some
    assert set(draws) <= set(np.flatnonzero(want))
    freq = np.bincount(draws, minlength=len(want)) / len(draws)
    np.testing.assert_array_less(np.abs(freq - want), 4 * np.sqrt(want * (1 - want) / len(draws)) + 1e-9)
    z = np.where(allowed, logits.astype(np.float64), -np.inf)
    logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    np.testing.assert_allclose(request.logprobs, logp[draws], rtol=0, atol=1e-5)
    assert [t for t, _ in request.top_logprobs[0]] == list(np.argsort(-logp, kind="stable")[:3])


def test_a_seeded_request_samples_the_same_tokens_whatever_runs_beside_it(model):
    fmt = formats.get("fp4")
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    prompt, others = prompts_with_shared_prefix()[0], prompts_with_shared_prefix(seed=2)
    alone = engine(model, fmt, blocks=64)
    a = alone.submit(prompt, 12, sampling=params)
    alone.run()
    crowded = engine(model, fmt, blocks=64, max_num_seqs=4)
    crowded.submit(others[0], 12, sampling=SamplingParams(temperature=1.0))  # draws from the engine's stream first
    b = crowded.submit(prompt, 12, sampling=params)
    for other in others[1:3]:
        crowded.submit(other, 12, sampling=SamplingParams(temperature=1.0))
    crowded.run()
    assert a.output == b.output and len(set(a.output)) > 3


def test_a_rows_token_depends_only_on_its_logits_parameters_and_key():
    """`core.sampling.sample` draws each row from its own key: rows without cuts get the same tokens whether or not
    other rows of the batch cut (top-k / top-p sort the batch), and greedy rows are the argmax over the allowed ids."""
    n = 64
    logits = jnp.asarray(np.random.default_rng(4).normal(0, 2, (n, CFG.vocab_size)), jnp.float32)
    keys = sampling.keys_from_words(np.array([sampling.key_words(5, i) for i in range(n)], np.uint32))
    allowed = sampling.allowed_ids(CFG.vocab_size, never=(256, 257), num_ids=259)
    temperature = jnp.where(jnp.arange(n) % 4 == 3, 0.0, 1.0)
    cuts = jnp.arange(n) % 2 == 1
    plain = sampling.sample(
        logits, keys, temperature=temperature, top_k=jnp.zeros(n, jnp.int32), top_p=jnp.ones(n), allowed=allowed
    )
    mixed = sampling.sample(
        logits,
        keys,
        temperature=temperature,
        top_k=jnp.where(cuts, 3, 0),
        top_p=jnp.where(cuts, 0.5, 1.0),
        allowed=allowed,
    )
    np.testing.assert_array_equal(np.asarray(plain)[~np.asarray(cuts)], np.asarray(mixed)[~np.asarray(cuts)])
    greedy = np.argmax(np.where(allowed, np.asarray(logits), -np.inf), axis=-1)
    np.testing.assert_array_equal(np.asarray(mixed)[3::4], greedy[3::4])
    assert np.all(allowed[np.asarray(mixed)]) and len(set(np.asarray(plain)[: n // 2].tolist())) > 10


def test_finish_and_abort_free_blocks_at_once_and_leave_others_exact(model):
    """Aborting a running request releases its blocks before the next step, aborting a waiting one drops it from
    the queue; the others still generate what they would alone, and each ends with its reason."""
    fmt = formats.get("bf16")
    eng = engine(model, fmt, blocks=16, max_num_seqs=2)
    prompts = prompts_with_shared_prefix()
    running, kept, waiting = (eng.submit(p, 10) for p in prompts[:3])
    eng.step()
    assert running in eng.running and waiting in eng.waiting and running.blocks
    held = len(running.blocks)
    free = eng.blocks.num_available
    eng.abort(running)
    assert not running.blocks and running.finish_reason == "abort" and eng.blocks.num_available == free + held
    eng.abort(waiting)
    assert waiting not in eng.waiting and waiting.finish_reason == "abort"
    eng.abort(waiting)  # a finished request is left as it is
    eng.run()
    assert kept.output == isolated(model, fmt, prompts[1], 10)
    assert kept.finish_reason == "length" and running.output == running.output[:1]
    assert eng.blocks.num_available == eng.pool.num_blocks


def generated(model, prompt, n, **ids):
    """Greedy generation of `prompt` by `core.generate` through the bf16 paged cache, batched as `isolated` batches
    it, with the special ids (or repetition penalty) `ids` given: its first n tokens."""
    fmt = formats.get("bf16")
    factory = paged_cache_factory(fmt, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim)
    batch = [np.asarray(prompt), np.ones(WIDTH, np.int32)]
    kw = {"tokenizer": ByteTokenizer(), "cache_factory": factory, **ids}
    return generate_lib.generate(model, batch, max_new_tokens=NEW, key=jax.random.key(0), **kw)[0, :n].tolist()


def test_end_ids_stop_token_ids_ignore_eos_and_min_tokens(model):
    """vLLM's stopping rules, with an end id E that the free greedy answer first emits at step k: a config whose
    eos_ids hold E stops there ("stop", end_id E); ignore_eos runs on past it to the length, unless E is among the
    request's own stop_token_ids, which end it all the same; with min_tokens = k + 2 no end id (EOS, E) is sampled
    before token k + 2: those tokens are core.generate's greedy choice over the other ids."""
    fmt = formats.get("bf16")
    prompt = prompts_with_shared_prefix()[3]
    free = engine(model, fmt, blocks=16)
    base = free.submit(prompt, 12, ignore_eos=True)
    free.run()
    answer = base.output
    k = next(i for i in range(2, 12) if answer[i] not in answer[:i] and answer[i] < 256)
    end = answer[k]
    eng = engine(model, fmt, blocks=32, eos_ids=(end,))
    assert eng.config.end_ids == (258, end)
    greedy = SamplingParams(temperature=0.0)
    stop = eng.submit(prompt, 12, sampling=greedy)
    ignored = eng.submit(prompt, 12, ignore_eos=True, sampling=greedy)
    own = eng.submit(prompt, 12, ignore_eos=True, sampling=SamplingParams(temperature=0.0, stop_token_ids=(end,)))
    held = eng.submit(prompt, 12, sampling=SamplingParams(temperature=0.0, min_tokens=k + 2))
    eng.run()
    assert (stop.output, stop.finish_reason, stop.end_id) == (answer[: k + 1], "stop", end)
    assert (ignored.output, ignored.finish_reason, ignored.end_id) == (answer, "length", None)
    assert (own.output, own.finish_reason, own.end_id) == (answer[: k + 1], "stop", end)
    assert held.output[: k + 2] == generated(model, prompt, k + 2, eos_id=None, never=(256, 257, 258, end))
    with pytest.raises(ValueError, match="min_tokens = 13 exceeds max_new_tokens = 12"):
        eng.submit(prompt, 12, sampling=SamplingParams(min_tokens=13))
    with pytest.raises(ValueError, match="stop_token_ids token at position 0 is 264, outside"):
        eng.submit(prompt, 12, sampling=SamplingParams(stop_token_ids=(264,)))


def test_the_repetition_penalty_is_one_rule_in_generation_and_the_engine(model):
    """`core.sampling.penalize` is transformers' and vLLM's rule (each seen id's logit divided by the penalty if
    positive, multiplied if not); greedy answers with penalties above and below 1 are the same from the engine (its
    requests' ids sent as bits, beside an unpenalised request in the same batches) as from core.generate (the ids
    tracked on the device), and differ from the unpenalised one."""
    rng = np.random.default_rng(0)
    logits, seen = rng.normal(0, 2, (3, 40)).astype(np.float32), rng.random((3, 40)) < 0.4
    penalty = np.array([1.3, 0.8, 1.0], np.float32)
    want = np.where(seen, np.where(logits > 0, logits / penalty[:, None], logits * penalty[:, None]), logits)
    np.testing.assert_allclose(sampling.penalize(jnp.asarray(logits), jnp.asarray(seen), penalty), want, rtol=1e-6)
    prompt = prompts_with_shared_prefix()[3] * 3  # repeats: the penalty has ids to act on
    eng = engine(model, formats.get("bf16"), blocks=32)
    plain = eng.submit(prompt, 10, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    penalised = {
        p: eng.submit(prompt, 10, ignore_eos=True, sampling=SamplingParams(temperature=0.0, repetition_penalty=p))
        for p in (1.8, 0.6)
    }
    eng.run()
    for p, request in penalised.items():
        assert request.output == generated(model, prompt, 10, eos_id=None, repetition_penalty=p), p
        assert request.output != plain.output, p


@pytest.mark.parametrize("vocab", [1, 33, 300, 151_936])
def test_id_sets_cross_as_bits_and_come_back_as_the_same_mask(vocab):
    """`core.sampling.pack_ids` -> `unpack_ids` gives back a bool mask equal to NumPy's of the ids (repeats and both
    ends included), for vocabularies that are and are not a multiple of 32."""
    rng = np.random.default_rng(vocab)
    ids = np.concatenate([rng.integers(0, vocab, 40), [0, vocab - 1, vocab - 1]])
    expected = np.zeros(vocab, bool)
    expected[ids] = True
    words = sampling.pack_ids(ids, vocab)
    assert words.dtype == np.uint32 and words.shape == (-(-vocab // 32),)
    np.testing.assert_array_equal(np.asarray(sampling.unpack_ids(jnp.asarray(words), vocab)), expected)


def test_several_decode_steps_per_call_draw_the_tokens_of_single_steps(model, monkeypatch):
    """K decode steps per device call (`EngineConfig.decode_steps`) give exactly what one step per call gives: tokens,
    log-probabilities and finish reasons of greedy, seeded and unseeded (the engine's stream) requests, and of one
    that meets its stop id inside a call (what the device computed past it is discarded, its blocks released); in
    fewer calls, the last of them running past the tokens the requests have left; and for a batch of greedy requests
    without log-probabilities (the plain sampler)."""
    from kvcache.serving import engine as engine_module

    calls = []
    many = engine_module.decode_steps

    def counted(*args, **kwargs):
        calls.append(1)
        return many(*args, **kwargs)

    monkeypatch.setattr(engine_module, "decode_steps", counted)
    fmt, prompts = formats.get("fp4"), prompts_with_shared_prefix()

    def serve(k, stop=None, plain=False):
        eng = engine(model, fmt, blocks=64, max_num_seqs=4, decode_steps=k)
        params = [  # (the unseeded request first: no request ahead of it finishes and shifts its row)
            SamplingParams(temperature=1.0, logprobs=True),
            SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
            SamplingParams(temperature=1.0, seed=5),
            SamplingParams(temperature=0.0, stop_token_ids=() if stop is None else (stop,)),
        ]
        if plain:  # every request greedy, none recording log-probabilities: the sampler's greedy path alone
            params = [SamplingParams(temperature=0.0, stop_token_ids=p.stop_token_ids) for p in params]
        requests = [eng.submit(p, 12, sampling=s) for p, s in zip(prompts, params)]
        eng.run()
        assert eng.blocks.num_available == eng.pool.num_blocks
        return [(r.output, r.finish_reason, r.logprobs, r.top_logprobs) for r in requests]

    free = serve(1)[3][0]
    stop = next(t for i, t in enumerate(free) if i >= 6 and t not in free[:i])  # met at step >= 6
    single = serve(1, stop)
    assert not calls and single[3][1] == "stop" and len(single[3][0]) < 12
    assert serve(4, stop) == single
    assert len(calls) == 3  # tokens 2..12 in three K-step calls, the last past the 11 tokens left
    assert serve(4, stop, plain=True) == serve(1, stop, plain=True)
