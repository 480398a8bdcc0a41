"""Test setup: 8 virtual CPU devices (set before JAX is imported) and small shared fixtures."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest


@pytest.fixture
def tiny_config():
    """A config small enough to train a few steps in seconds, on a tiny in-memory-sized corpus."""
    from experiments import build

    c = build.default_config()
    c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.num_kv_heads, c.model.d_ff = 32, 2, 4, 2, 64
    c.data.seq_len, c.data.batch_size = 16, 8
    c.optim.warmup_steps = 2
    c.train.steps, c.train.log_every, c.train.eval_every, c.train.eval_batches = 6, 1, 3, 2
    c.train.progress = False
    c.checkpoint.every = 2
    c.sample.num_tokens = 0
    return c
