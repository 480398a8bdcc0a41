"""Optimizer step time: each MGUP variant against its base optax optimizer, side by side in one run.

    python -m experiments.bench.optim [--d-model 640] [--layers 10] [--repeats 5] [--out runs/bench]

The pytree is transformer-shaped (per layer: q, k, v, o of d x d, an MLP of d x 4d and 4d x d, two norms; a
256 x d embedding): about 49M parameters at the defaults, float32, on one device. Time = one jitted
`update + apply_updates` with the state and parameters donated, random gradients, median of `--repeats` rounds in
which every optimizer runs once (interleaved). Pairs: AdamW (optax) / MGUP-AdamW (exact and approx selection),
C-AdamW, Cautious-MGUP-AdamW; Lion (optax) / MGUP-Lion; Muon (optax.contrib) / our Muon / MGUP-Muon. Goals on CPU:
MGUP-AdamW / AdamW <= 1.25 with exact top-k, <= 1.10 with the approximate selection. Writes optim.json and
optim.md into `--out` (`--out results/bench` for the table docs/mgup.md quotes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import command, harness
from experiments.harness import interleaved_medians
from optim import cautious_adamw, cautious_mgup_adamw, mgup_adamw, mgup_lion, mgup_muon

GOALS = {"mgup_adamw": 1.25, "mgup_adamw_approx": 1.10}


def transformer_pytree(d: int, layers: int, seed: int = 0) -> dict:
    """A transformer-shaped float32 parameter pytree: a 256 x d embedding and per layer q, k, v, o (d x d), an MLP
    (d x 4d, 4d x d) and two norms (d), N(0, 0.02^2) entries (norms ones)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.02, jnp.float32)  # noqa: E731
    tree: dict[str, Any] = {"embedding": normal(256, d)}
    for i in range(layers):
        tree[f"layer_{i}"] = {
            "q": normal(d, d),
            "k": normal(d, d),
            "v": normal(d, d),
            "o": normal(d, d),
            "mlp_up": normal(d, 4 * d),
            "mlp_down": normal(4 * d, d),
            "norm_1": jnp.ones((d,), jnp.float32),
            "norm_2": jnp.ones((d,), jnp.float32),
        }
    return tree


def optimizers() -> dict[str, tuple[str, optax.GradientTransformation]]:
    """name -> (base it is compared with, transformation)."""
    return {
        "adamw": ("adamw", optax.adamw(1e-3, weight_decay=0.1)),
        "mgup_adamw": ("adamw", mgup_adamw(1e-3, weight_decay=0.1)),
        "mgup_adamw_approx": ("adamw", mgup_adamw(1e-3, weight_decay=0.1, selection="approx")),
        "cautious_adamw": ("adamw", cautious_adamw(1e-3, weight_decay=0.1)),
        "cautious_mgup_adamw": ("adamw", cautious_mgup_adamw(1e-3, weight_decay=0.1)),
        "lion": ("lion", optax.lion(1e-4, weight_decay=0.1)),
        "mgup_lion": ("lion", mgup_lion(1e-4, weight_decay=0.1)),
        "mgup_lion_approx": ("lion", mgup_lion(1e-4, weight_decay=0.1, selection="approx")),
        "muon_ours": ("muon", mgup_muon(1e-3, mgup=False)),
        "mgup_muon": ("muon", mgup_muon(1e-3)),
        "muon": ("muon", optax.contrib.muon(1e-3, weight_decay=0.1, adam_weight_decay=0.1)),
    }


def measure(d: int, layers: int, repeats: int) -> dict:
    """Every optimizer's jitted update + apply on the pytree, timed in interleaved rounds; rows with the ratio to
    its base."""
    params = transformer_pytree(d, layers)
    grads = jax.tree.map(lambda x: jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32), params)
    calls: dict[str, Callable[[], object]] = {}
    table = optimizers()
    for name, (_, tx) in table.items():
        step = jax.jit(
            lambda p, s, g, tx=tx: (lambda u, s2: (optax.apply_updates(p, u), s2))(*tx.update(g, s, p)),
            donate_argnums=(0, 1),
        )
        box = {"p": jax.tree.map(jnp.copy, params), "s": tx.init(params)}

        def call(step=step, box=box):
            box["p"], box["s"] = step(box["p"], box["s"], grads)
            return box["p"]

        calls[name] = call
    seconds = interleaved_medians(calls, repeats=repeats, warmup=2, what="the optimizer steps")
    count = sum(x.size for x in jax.tree.leaves(params))
    rows = [
        {
            "optimizer": name,
            "base": base,
            "seconds": seconds[name],
            "ratio": seconds[name] / seconds[base],
            "goal": GOALS.get(name),
        }
        for name, (base, _) in table.items()
    ]
    return {"params": count, "d_model": d, "layers": layers, "repeats": repeats, "rows": rows}


def markdown(result: dict) -> str:
    """optim.md: step time per optimizer, its ratio to its base and the goal."""
    lines = [
        "# Optimizer step time",
        "",
        f"`{result['command']}`: {result['params'] / 1e6:.1f}M float32 parameters "
        f"(transformer-shaped, d_model {result['d_model']}, {result['layers']} layers), jitted update + apply, "
        f"median of {result['repeats']} interleaved rounds.",
        "",
        "| optimizer | base | step (ms) | / base | goal |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        goal = "" if r["goal"] is None else f"<= {r['goal']:.2f} ({'met' if r['ratio'] <= r['goal'] else 'missed'})"
        lines.append(f"| {r['optimizer']} | {r['base']} | {1e3 * r['seconds']:.1f} | {r['ratio']:.2f}x | {goal} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.bench.optim", topic="bench", repeats=5)
    parser = study.parser
    parser.add_argument(
        "--d-model", type=harness.integer(1), default=640, help="model width d of the parameter pytree, >= 1"
    )
    parser.add_argument(
        "--layers", type=harness.integer(1), default=10, help="transformer layers of the parameter pytree, >= 1"
    )
    args = study.parse(argv)
    study.write("optim", measure(args.d_model, args.layers, args.repeats), markdown)


if __name__ == "__main__":
    command.run(main)
