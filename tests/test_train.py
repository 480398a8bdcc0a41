"""Training loop: loss and schedule against formulas, exact resume, NaN guard, checkpoint refusal."""

import io
import json
import math
import os
import shutil
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_logging import event_scalars, jsonl_scalars

from core import checkpoint as checkpoint_lib
from core import train as train_lib
from core.byte_tokenizer import PAD_ID, TokenizerError
from core.fields import ConfigError
from core.hf_tokenizer import HFTokenizer
from core.model import Transformer, TransformerConfig, split_params
from core.workdir import WorkdirError
from experiments import build, schema

from helpers import by_key_path, forward, make_tiny_config, metric_rows


def _train(config, workdir, hooks=(), optimizer=None):
    corpus, batches = build.build_data(config)
    _, sharder = build.build_mesh(config)
    return train_lib.train(
        config,
        workdir=str(workdir),
        model_fn=build.build_model_fn(config, sharder),
        optimizer=optimizer or build.build_optimizer(config),
        batches=batches,
        sharder=sharder,
        compat=schema.checkpoint_compat(config, corpus.fingerprint),
        hooks=hooks,
    )


def test_weight_decay_applies_to_matrices_only():
    cfg = TransformerConfig(d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, d_ff=32, norm="layernorm")
    params = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    mask = {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(build.decay_mask(params))}
    assert mask.pop("embedding") is False
    for name, decayed in mask.items():
        assert decayed == name.endswith("kernel"), name


def test_lm_loss_matches_numpy_cross_entropy():
    cfg = TransformerConfig(d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, d_ff=32)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = np.array(jax.random.randint(jax.random.key(0), (3, 11), 0, 259))
    tokens[0, 5:] = PAD_ID  # padded tail: not counted
    loss, metrics = nnx.jit(train_lib.lm_loss)(model, jnp.asarray(tokens))
    logits = np.asarray(forward(model, jnp.asarray(tokens[:, :-1]))[0], np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    targets = tokens[:, 1:]
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    mask = targets != PAD_ID
    np.testing.assert_allclose(float(loss), (nll * mask).sum() / mask.sum(), rtol=1e-5)
    assert float(metrics["loss"]) == float(loss)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedule_matches_formula(schedule):
    o = schema.default_config().optim
    o.learning_rate, o.warmup_steps, o.min_lr_ratio, o.schedule = 1e-2, 10, 0.1, schedule
    lr = train_lib.learning_rate_schedule(o, 110)
    for step in (0, 5, 10, 35, 60, 109, 110):
        if step < 10:
            expected = 1e-2 * step / 10
        else:
            frac = (step - 10) / 100
            expected = {
                "cosine": 1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))),
                "linear": 1e-2 * (1 - 0.9 * frac),
                "constant": 1e-2,
            }[schedule]
        np.testing.assert_allclose(float(lr(step)), expected, rtol=1e-5, atol=1e-9)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished run of the tiny config (6 steps, a checkpoint every 2): (workdir, result). Tests that touch it
    work on a copy."""
    workdir = tmp_path_factory.mktemp("finished")
    return workdir, _train(make_tiny_config(), workdir)


def _copy_of(finished, tmp_path):
    shutil.copytree(finished[0], tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_resume_after_crash_equals_uninterrupted_run(finished, tiny_config, tmp_path):
    """Crash at step 5 (last checkpoint at 4), rerun: metrics.jsonl, the TensorBoard scalars and results equal an
    uninterrupted run. (A sharded state's resume: test_cli's federated crash, its state sharded over 4 sites.)"""
    full_dir, full = finished

    class Crash(Exception):
        pass

    def crash_at_5(step, metrics):
        if step == 5:
            raise Crash

    with pytest.raises(Crash):
        _train(tiny_config, tmp_path / "crashed", hooks=[crash_at_5])
    assert checkpoint_lib.Checkpointer(tmp_path / "crashed" / "checkpoints").latest_step() == 4
    resumed = _train(tiny_config, tmp_path / "crashed")
    assert resumed["resumed_from"] == 4
    assert metric_rows(tmp_path / "crashed") == metric_rows(full_dir)
    # TensorBoard shows metrics.jsonl's rows: step 5, logged by the crashed run too, once (purged from its file)
    assert event_scalars(full_dir) == jsonl_scalars(full_dir) and "val_bits_per_byte" in event_scalars(full_dir)
    assert event_scalars(tmp_path / "crashed") == jsonl_scalars(tmp_path / "crashed")
    for key in ("train_loss", "val_loss", "val_bits_per_byte", "steps"):
        assert resumed[key] == full[key], key
    for a, b in zip(jax.tree.leaves(resumed["final_state"]), jax.tree.leaves(full["final_state"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Rows of the crashed run after its checkpoint were set aside, not lost.
    superseded = tmp_path / "crashed" / "metrics.superseded.jsonl"
    assert superseded.exists() and all(json.loads(r)["step"] == 5 for r in superseded.read_text().splitlines())


def test_rerun_of_a_finished_run_changes_nothing(finished, tmp_path):
    workdir = _copy_of(finished, tmp_path)
    rows = metric_rows(workdir)
    again = _train(make_tiny_config(), workdir)
    assert again["resumed_from"] == finished[1]["steps"] and metric_rows(workdir) == rows
    assert again["val_loss"] == finished[1]["val_loss"]
    assert again["tokens_per_second"] == finished[1]["tokens_per_second"] is not None  # kept in the checkpoint


def test_nan_guard_stops_with_step_and_keeps_last_good_checkpoint(tiny_config, tmp_path):
    c = tiny_config
    c.optim.learning_rate, c.optim.warmup_steps, c.optim.grad_clip_norm, c.optim.weight_decay = 1e30, 0, 0.0, 0.0
    c.checkpoint.every = 1
    with pytest.raises(train_lib.NonFiniteLossError) as e:
        _train(c, tmp_path)
    step = e.value.step
    assert step >= 2 and e.value.last_checkpoint == step - 1
    assert f"step {step}" in str(e.value) and f"step {step - 1}" in str(e.value)
    ckpt = checkpoint_lib.Checkpointer(tmp_path / "checkpoints", keep=c.checkpoint.keep)
    assert ckpt.latest_step() == step - 1
    rows = metric_rows(tmp_path)
    assert all(math.isfinite(r.get("train_loss", 0.0)) for r in rows) and max(r["step"] for r in rows) == step - 1


def test_nan_guard_checks_the_state_it_would_save(tiny_config, tmp_path):
    """AdamW with eps = 0 and an untied embedding: rows of bytes absent from the batch get 0/0 = NaN in the update
    while the loss and gradient stay finite. Nothing is saved, the run stops at step 1, and the advice names eps.
    (A config refuses eps = 0 before anything runs, experiments.optimizers; a library caller's own optimizer is not
    checked, so the guard is tested with one.)"""
    c = tiny_config
    c.optim.eps, c.model.tie_embeddings, c.checkpoint.every, c.train.steps = 0.0, False, 1, 1
    with pytest.raises(ConfigError, match="'optim.eps' = 0.0"):
        build.build_optimizer(c)
    optimizer = optax.chain(
        optax.clip_by_global_norm(c.optim.grad_clip_norm), optax.adamw(3e-3, b1=0.9, b2=0.95, eps=0.0)
    )
    with pytest.raises(train_lib.NonFiniteLossError) as e:
        _train(c, tmp_path, optimizer=optimizer)
    assert e.value.step == 1 and e.value.last_checkpoint is None
    assert "non-finite values" in str(e.value) and "params/embedding" in str(e.value), str(e.value)
    assert "optim.eps = 0" in str(e.value) and "already clipped" in str(e.value), str(e.value)
    assert checkpoint_lib.Checkpointer(tmp_path / "checkpoints").latest_step() is None


def test_incompatible_checkpoint_is_refused_and_left_untouched(finished, tmp_path):
    workdir = _copy_of(finished, tmp_path)
    before = _snapshot(workdir)
    other = make_tiny_config()
    other.model.d_model = 64
    with pytest.raises(checkpoint_lib.CheckpointError, match="d_model: checkpoint 32, now 64"):
        _train(other, workdir)
    other = make_tiny_config()
    other.data.seq_len = 32
    with pytest.raises(checkpoint_lib.CheckpointError, match="data.seq_len"):
        _train(other, workdir)
    assert _snapshot(workdir) == before


def test_corrupt_checkpoint_is_refused_and_left_untouched(finished, tmp_path):
    workdir = _copy_of(finished, tmp_path)
    steps = finished[1]["steps"]
    latest = workdir / "checkpoints" / str(steps)
    victims = [p for p in (latest / "state").rglob("*") if p.is_file() and p.stat().st_size > 64]
    assert victims
    for p in victims:  # truncate every array file: the data is gone
        p.write_bytes(p.read_bytes()[:16])
    before = _snapshot(workdir)
    with pytest.raises(checkpoint_lib.CheckpointError, match=f"step {steps}"):
        _train(make_tiny_config(), workdir)
    assert _snapshot(workdir) == before


def test_checkpoint_steps_beyond_config_are_refused(finished, tmp_path):
    workdir = _copy_of(finished, tmp_path)
    config = make_tiny_config()
    config.train.steps = 4
    config.optim.warmup_steps = 1
    with pytest.raises(checkpoint_lib.CheckpointError, match="beyond train.steps"):
        _train(config, workdir)


def _snapshot(root):
    """Every file's bytes under `root`, except the workdir lock's record (who holds it now)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in set(files) - {".lock"}:
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                out[p] = f.read()
    return out


def test_eval_bits_per_byte_formula():
    """bits/byte = total NLL over non-PAD targets / (ln 2 x byte targets); specials count as cost, not bytes."""
    cfg = TransformerConfig(d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, d_ff=32)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    graphdef, params, rest = split_params(model)
    tokens = np.array(jax.random.randint(jax.random.key(0), (2, 9), 0, 256))
    tokens[0, 3], tokens[1, 6:] = 258, PAD_ID
    out = train_lib.make_eval_step(graphdef)(params, rest, jnp.asarray(tokens))
    state = train_lib.TrainState(jnp.int32(0), params, rest, None, jax.random.key(0))  # evaluation reads neither
    ev = train_lib.evaluate(train_lib.make_eval_step(graphdef), state, [jnp.asarray(tokens)] * 2)
    assert int(out["tokens"]) == 8 + 5 and int(out["bytes"]) == 7 + 5
    np.testing.assert_allclose(ev["val_bits_per_byte"], float(out["nll_sum"]) / (math.log(2) * 12), rtol=1e-6)
    np.testing.assert_allclose(ev["val_loss"], float(out["nll_sum"]) / 13, rtol=1e-6)


_OPTIMIZERS = {  # a mask (MaskedNode leaves), a partition by shape (muon), a chain with clipping
    "adamw_masked": lambda: optax.adamw(1e-3, mask=build.decay_mask),
    "muon": lambda: optax.contrib.muon(1e-3),
    "clipped_lion": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-4)),
}


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_optimizer_state_shardings_follow_the_parameters(name):
    """optimizer_state_like (optax.tree_utils.tree_map_params) gives every moment its parameter's sharding and
    every other leaf the default: the same tree as matching key paths and shapes (helpers.by_key_path)."""
    from core import mesh as mesh_lib
    from core.mesh_config import DEFAULT_RULES

    cfg = TransformerConfig(d_model=32, num_layers=1, num_heads=4, num_kv_heads=4, d_ff=64)
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    sharder = mesh_lib.Sharder(mesh, DEFAULT_RULES)
    _, params, _ = split_params(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    shardings, replicated = mesh_lib.param_shardings(params, sharder), sharder.named(())
    optimizer = _OPTIMIZERS[name]()
    opt_state = jax.eval_shape(optimizer.init, params)
    got = train_lib.optimizer_state_like(optimizer, opt_state, params, shardings, replicated)
    want = by_key_path(opt_state, params, shardings, replicated)
    chex.assert_trees_all_equal_structs(got, want)
    assert jax.tree.leaves(got) == jax.tree.leaves(want)
    assert any(s != replicated for s in jax.tree.leaves(got))  # the moments of sharded matrices are sharded


_OFF = r"needs the package .*lowbit-moe-lab\[experiments\].* turn the .* off"
_BPE = json.dumps(
    {
        "model": {"type": "BPE", "vocab": {}, "merges": []},
        "decoder": {"type": "ByteLevel"},
        "pre_tokenizer": {"type": "ByteLevel"},
    }
)


@pytest.mark.parametrize(
    "package, needed_by, error, message",
    [
        (
            ("tqdm", "tqdm.auto"),
            lambda: train_lib.progress_bar(0, 3, enabled=True, stream=_Terminal()),
            ImportError,
            _OFF,
        ),
        (
            ("tensorboardX", "tensorboardX.event_file_writer"),
            lambda: train_lib.tensorboard_enabled(_tensorboard()),
            WorkdirError,
            _OFF,
        ),
        (
            ("tokenizers",),
            lambda: HFTokenizer(_BPE),
            TokenizerError,
            r"needs the package tokenizers.*\[experiments\].* 'bytes'",
        ),
    ],
    ids=["tqdm", "tensorboardX", "tokenizers"],
)
def test_a_missing_optional_package_names_the_extra_that_installs_it(monkeypatch, package, needed_by, error, message):
    for module in package:
        monkeypatch.setitem(sys.modules, module, None)  # import then raises ImportError
    with pytest.raises(error, match=message):
        needed_by()


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _tensorboard():
    config = make_tiny_config()
    config.train.tensorboard = True
    return config
