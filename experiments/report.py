"""What a run shows a person: parameter count, summary table, loss-curve plot, a text sample."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from core import fields as fields_lib
from core import generate
from core import model as model_lib
from experiments import build, plotting
from moe.config import MoEConfig

LN2 = math.log(2.0)


def count_params(model_fn: Callable[[nnx.Rngs], nnx.Module]) -> int:
    """Parameters of the model `model_fn` builds, counted on abstract shapes (nothing is allocated)."""
    return model_lib.count_params(nnx.eval_shape(lambda: model_fn(nnx.Rngs(0))))


def moe_summary(config, num_params: int, *, metrics_path: str) -> dict:
    """For a MoE model: parameters used per token (the top-k of each MoE layer's experts, not all of them) and the
    routing statistics of the last logged step. Empty for a dense model."""
    m = fields_lib.from_config(MoEConfig, config.moe)
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


def run_settings(config: Mapping[str, Any]) -> str:
    """One line naming a run's key settings, from its resolved config (config.json): model shape, FFN, federation,
    optimizer, GEMM recipe, steps x batch x sequence, seed, corpus. E.g. "d_model 128 x 4 layers, MoE 8 experts
    of 128 (top-2) in every block, 2 FoMoE sites (O_e 1, K 10, local_adamw), adamw lr 0.005, GEMMs none,
    700 steps x 8 x 256 tokens, seed 0, built-in corpus"."""
    m, moe, mesh, data = config["model"], config.get("moe", {}), config.get("mesh", {}), config["data"]
    parts = [f"d_model {m['d_model']} x {m['num_layers']} layers"]
    every = moe.get("every", 0)
    if every:
        where = "every block" if every == 1 else f"every {every} blocks"
        parts.append(f"MoE {moe['num_experts']} experts of {moe['expert_size']} (top-{moe['top_k']}) in {where}")
    else:
        parts.append(f"dense FFN {m.get('mlp', '')} d_ff {m.get('d_ff')}".replace("  ", " "))
    sites = mesh.get("site", 1)
    if sites > 1:
        f = config.get("fomoe", {})
        parts.append(f"{sites} FoMoE sites (O_e {f.get('overlap')}, K {f.get('local_steps')}, {f.get('outer')})")
    o = config["optim"]
    parts.append(f"{o['name']} lr {o['learning_rate']:g}")
    if "precision" in config:
        parts.append(f"GEMMs {config['precision']['recipe']}")
    t = config["train"]
    parts.append(f"{t['steps']} steps x {data['batch_size']} x {data['seq_len']} tokens, seed {t['seed']}")
    parts.append(os.path.basename(data["path"].rstrip("/")) if data.get("path") else "built-in corpus")
    if data.get("tokenizer"):
        parts.append(f"tokenizer {os.path.basename(str(data['tokenizer']).rstrip('/'))}")
    return ", ".join(parts)


def run_title(workdir: str) -> str:
    """The title of a run's plots: "run <workdir>" and, on a second line, `run_settings` of the workdir's
    config.json (the line is left out when there is no config.json)."""
    return _title(workdir, _saved_config(workdir))


def _saved_config(workdir: str) -> dict | None:
    """The workdir's config.json, or None without one."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _title(workdir: str, config: dict | None) -> str:
    return f"run {workdir}" if config is None else f"run {workdir}\n{run_settings(config)}"


def plot_loss_curve(metrics_path: str, out_path: str, *, title: str | None = None) -> None:
    """Train loss and held-out bits per byte against step, from metrics.jsonl; beside it, for a MoE model, the
    routing balance (expert-load CV and load entropy) against step. One unit per axis: for a run of the byte
    tokenizer (`data.tokenizer = "bytes"` in the workdir's config.json, or no config.json) a token is a byte and both
    curves share the bits-per-byte axis; for any other tokenizer the train loss (bits per token) has its own axis on
    the left and the held-out bits per byte theirs on the right. The figure's title says which run it shows:
    `title`, by default `run_title` of the directory holding metrics.jsonl (its workdir)."""
    workdir = os.path.dirname(metrics_path) or "."
    saved = _saved_config(workdir)
    title = _title(workdir, saved) if title is None else title
    byte_tokens = saved is None or saved.get("data", {}).get("tokenizer", "bytes") == "bytes"
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train = [(r["step"], r["train_loss"] / LN2) for r in rows if "train_loss" in r]
    val = [(r["step"], r["val_bits_per_byte"]) for r in rows if "val_bits_per_byte" in r]
    routing = [(r["step"], r["moe/load_cv"], r["moe/load_entropy"]) for r in rows if "moe/load_cv" in r]
    ncols = 2 if routing else 1
    with plotting.figure(
        out_path, size=(11 if routing else 6.5, 4.4), ncols=ncols, squeeze=False, legend_size="medium", title=title
    ) as axes:
        ax = axes[0]
        held = ax if byte_tokens else ax.twinx()
        if train:
            what = "train loss (bits / byte token)" if byte_tokens else "train loss (bits / token, left axis)"
            ax.plot(*zip(*train), label=what, lw=1.2, color="C0")
        if val:
            what = "held-out bits / byte" + ("" if byte_tokens else " (right axis)")
            held.plot(*zip(*val), "o-", lw=1.2, ms=3, color="C1")
            ax.plot([], [], "o-", label=what, lw=1.2, ms=3, color="C1")  # (the legend is the left axis')
        held.axhline(8.0, color="grey", ls=":", lw=0.8)
        ax.plot([], [], color="grey", ls=":", lw=0.8, label="uniform over bytes (8 bits / byte)")
        ax.set_xlabel("step")
        if byte_tokens:
            ax.set_ylabel("bits per byte")
            ax.set_ylim(0, max(9.0, 1.05 * max((v for _, v in train + val), default=9.0)))
        else:
            ax.set_ylabel("train loss, bits per token")
            held.set_ylabel("held-out bits per byte")
            ax.set_ylim(0, 1.05 * max((v for _, v in train), default=1.0))
            held.set_ylim(0, max(9.0, 1.05 * max((v for _, v in val), default=9.0)))
        ax.set_title("Training loss and held-out bits per byte", fontsize=9)
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
