"""Our side of `experiments.bench.peer`'s train step, one measurement per process: run by the benchmark under each
process setting it compares (the library's host-memory settings, glibc's defaults, a preloaded allocator).

    python -m experiments.bench.peer_ours --model qwen3 --size quickstart --tokens FILE.npy [--repeats 5] [--warmup 2]

Builds the model of `--model` / `--size` (`MODELS`, `SIZES`; parameters from seed 0, so every process and the
exported checkpoint hold the same model), reads the token batch [B, T + 1] (int32 .npy) and times our four phases
in interleaved rounds (median of `--repeats` after `--warmup`):
  forward           the next-token cross-entropy of the batch, no gradients (one jitted program)
  forward_backward  the loss and its gradients
  step              forward_backward and an AdamW update (optax.adamw), nothing else
  step_with_extras  the training loop's step (core.train.make_train_step with the config's optimizer: gradient
                    clipping, the warm-up + cosine schedule, weight-decay mask, and its metrics: the MoE's auxiliary
                    losses and routing statistics, the gradient norm)
Prints one JSON object: the medians in seconds, the first forward's loss, whether the
library's host-memory settings took (`core.host_memory`: LOWBIT_HOST_MALLOC=system leaves glibc's defaults) and the
allocator the process runs on (read from its own memory map, as peer_torch.py does).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from core import host_memory
from experiments import command, harness

MODELS = {
    "qwen3": {"moe": {"every": 0}, "model": {"qk_norm": True}},
    "qwen3_moe": {
        "moe": {"router": "softmax", "normalize_gates": True, "expert_mlp": "swiglu"},
        "model": {"qk_norm": True},
    },
}
SIZES = {
    "quickstart": {},
    "8x": {
        "model": {"d_model": 256, "num_layers": 8, "num_heads": 4, "num_kv_heads": 2, "d_ff": 768},
        "moe": {"expert_size": 256},
    },
}
PHASES = ("forward", "forward_backward", "step")


def config_for(model: str, size: str):
    """The quickstart config with the model's and size's overrides, on one device."""
    from experiments.configs import quickstart

    c = quickstart.get_config()
    for overrides in (MODELS[model], SIZES[size]):
        for section, values in overrides.items():
            c[section].update(values)
    c.mesh.update(site=1, data=1)
    return c


def batch_for(config) -> np.ndarray:
    """The benchmark's token batch [batch_size, seq_len + 1] (int32, random bytes, seed 0)."""
    tokens = np.random.default_rng(0).integers(0, 256, (config.data.batch_size, config.data.seq_len + 1))
    return tokens.astype(np.int32)


def ours(config, tokens: np.ndarray) -> tuple[dict[str, Callable[[], object]], float]:
    """({phase: a call running it} for our four phases, the first forward's loss). The step calls carry their
    state from call to call."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from core import train as train_lib

    graphdef, state, optimizer = harness.one_device_state(config)
    batch = jnp.asarray(tokens)

    def loss(params, batch):
        logits, _, _ = nnx.merge(graphdef, params, state.rest)(batch[:, :-1])
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]))

    adamw = optax.adamw(1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    forward = jax.jit(loss)
    forward_backward = jax.jit(jax.value_and_grad(loss))

    @jax.jit
    def bare_step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = adamw.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    full_step = train_lib.make_train_step(graphdef, optimizer)
    first_loss = float(forward(state.params, batch))
    carried = {"bare": (state.params, adamw.init(state.params)), "full": jax.tree.map(jnp.copy, state)}

    def run_bare():
        params, opt_state, value = bare_step(*carried["bare"], batch)
        carried["bare"] = (params, opt_state)
        return value

    def run_full():  # the state is donated: thread it through
        carried["full"], metrics = full_step(carried["full"], batch)
        return metrics

    calls = {
        "forward": lambda: forward(state.params, batch),
        "forward_backward": lambda: forward_backward(state.params, batch),
        "step": run_bare,
        "step_with_extras": run_full,
    }
    return calls, first_loss


def allocator() -> str:
    """ "jemalloc" or "tcmalloc" when such a library is mapped into this process (LD_PRELOAD), else "glibc" (the
    torch side's script has its own copy: it imports nothing of this repository)."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    return next((name for name in ("jemalloc", "tcmalloc") if f"lib{name}" in maps), "glibc")


def main(argv: list[str] | None = None) -> None:
    """The command line: see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m experiments.bench.peer_ours", description=__doc__)
    parser.add_argument("--model", choices=list(MODELS), required=True)
    parser.add_argument("--size", choices=list(SIZES), required=True)
    parser.add_argument("--tokens", required=True, help="an int32 .npy of token ids [B, T + 1]")
    parser.add_argument("--repeats", type=harness.integer(1), default=5, help="timed rounds, >= 1")
    parser.add_argument("--warmup", type=harness.integer(0), default=2, help="untimed rounds first, >= 0")
    args = parser.parse_args(argv)
    config = config_for(args.model, args.size)
    tokens = np.load(args.tokens)
    expected = batch_for(config).shape
    if tokens.shape != expected or tokens.dtype != np.int32:
        parser.error(f"--tokens = {args.tokens!r}: int32 {tokens.shape}; allowed: int32 {expected}")
    calls, first_loss = ours(config, tokens)
    seconds = harness.interleaved_medians(calls, repeats=args.repeats, warmup=args.warmup)
    result: dict[str, Any] = {"seconds": seconds, "loss": first_loss}
    result.update(host_memory=host_memory.applies(), allocator=allocator())
    print(json.dumps(result))


if __name__ == "__main__":
    command.run(main)
