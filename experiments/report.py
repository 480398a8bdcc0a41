"""What a run shows a person: parameter count, summary table, loss-curve plot, a text sample."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from core import config as config_lib
from core import model as model_lib
from moe.config import MoEConfig

LN2 = math.log(2.0)


def count_params(model_fn: Callable[[nnx.Rngs], nnx.Module]) -> int:
    """Parameters of the model `model_fn` builds, counted on abstract shapes (nothing is allocated)."""
    return model_lib.count_params(nnx.eval_shape(lambda: model_fn(nnx.Rngs(0))))


def moe_summary(config, num_params: int, *, metrics_path: str) -> dict:
    """For a MoE model: parameters used per token (the top-k of each MoE layer's experts, not all of them) and the
    routing statistics of the last logged step. Empty for a dense model."""
    m = config_lib.from_config(MoEConfig, config.moe)
    layers = sum(map(m.is_moe_layer, range(config.model.num_layers)))
    if not layers:
        return {}
    idle = layers * (m.num_experts - m.top_k) * 2 * config.model.d_model * m.expert_size
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    last: dict[str, Any] = next((r for r in reversed(rows) if "moe/load_cv" in r), {})
    return {"active_params_per_token": num_params - idle, **{k: v for k, v in last.items() if k.startswith("moe/")}}


def summary_table(summary: dict) -> str:
    """A two-column text table of the summary."""
    rows = [
        (k, f"{v:,.4f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v))
        for k, v in summary.items()
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line, *(f"{k:<{width}} | {v}" for k, v in rows), line])


def plot_loss_curve(metrics_path: str, out_path: str) -> None:
    """Train loss and held-out bits per byte against step, in bits, from metrics.jsonl; beside it, for a MoE
    model, the routing balance (expert-load CV and load entropy) against step."""
    from experiments import plotting

    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train = [(r["step"], r["train_loss"] / LN2) for r in rows if "train_loss" in r]
    val = [(r["step"], r["val_bits_per_byte"]) for r in rows if "val_bits_per_byte" in r]
    routing = [(r["step"], r["moe/load_cv"], r["moe/load_entropy"]) for r in rows if "moe/load_cv" in r]
    ncols = 2 if routing else 1
    with plotting.figure(
        out_path, size=(11 if routing else 6, 4), ncols=ncols, squeeze=False, legend_size="medium"
    ) as axes:
        ax = axes[0]
        if train:
            ax.plot(*zip(*train), label="train loss (bits / token)", lw=1.2)
        if val:
            ax.plot(*zip(*val), "o-", label="held-out bits / byte", lw=1.2, ms=3)
        ax.axhline(8.0, color="grey", ls=":", lw=0.8, label="uniform over bytes (8 bits)")
        ax.set_xlabel("step")
        ax.set_ylabel("bits")
        ax.set_ylim(0, max(9.0, 1.05 * max((v for _, v in train + val), default=9.0)))
        if routing:
            steps, cv, entropy = zip(*routing)
            ax = axes[1]
            ax.plot(steps, cv, label="expert load CV (0 = balanced)", lw=1.2)
            ax.plot(steps, entropy, label="load entropy / log E (1 = balanced)", lw=1.2)
            ax.set_xlabel("step")
            ax.set_title("MoE routing (mean over MoE layers)", fontsize=9)
            ax.set_ylim(0, max(1.1, 1.05 * max(cv)))


def sample_text(config, model_fn, results) -> str:
    """Continues `config.sample.prompt` with the trained model (KV-cached generation), encoded and decoded by
    the run's tokenizer (`data.tokenizer`), ending at its EOS."""
    from core import generate
    from experiments import build

    model = nnx.merge(results["graphdef"], results["final_state"].params, results["final_state"].rest)
    tok = build.build_tokenizer(config)
    s = config.sample
    out = generate.generate(
        model,
        [tok.encode(s.prompt)],
        max_new_tokens=s.num_tokens,
        key=jax.random.PRNGKey(config.train.seed),
        temperature=s.temperature,
        top_k=s.top_k,
        cache_factory=build.build_cache_factory(config, model),
        eos_id=tok.eos_id,
        never=tok.never_sampled,
        num_ids=tok.vocab_size,
        pad_id=tok.eos_id if tok.pad_id is None else tok.pad_id,
    )
    return s.prompt + tok.decode(out[0])
