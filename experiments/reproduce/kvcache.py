"""UltraQuant at CPU scale: KV-format quality on a trained model's and on synthetic K/V, the held-out perplexity of
the model decoding through each cache format, and the capacity table of the spec's model.

    python -m experiments.reproduce.kvcache [--out runs/kvcache] [--parts quality,perplexity,capacity]

model: the quickstart MoE (experiments/configs/quickstart.py, d_model 128, 4 layers, 2 query heads sharing one KV
head of dim 64) trained on one device for 400 steps (`<out>/runs/model`, its progress shown prefixed by `[model]`;
reused when finished). Everything goes into `--out` (`--out results/kvcache` for the tables and plot
docs/kvcache.md quotes).

quality: attention-output relative error ||o_fmt - o|| / ||o|| against float32 attention on the unquantised K/V
(all causal positions of 8 held-out sequences x 256 tokens, every layer; q, k, v recorded from the model's own
forward), and on synthetic K with outlier channels (2 of 128 channels x 20, 4 x 1024 tokens, 2 KV heads, GQA 4).
Formats: bf16; fp8; fp4 with both scale rules, with and without K rotation, symmetric (K and V rotated) against
UltraQuant's asymmetric treatment (only K), and with the query in fp32 instead of FP8; fp4 on the uniform E1M2 grid
(INT4 stores the same values: kvcache.codecs); NVFP4 (E4M3 scales per 16, "max" and "4 over 6"); K8V4 (fp8 keys,
fp4 values). Beside the errors, the gains <a_fmt, a> / <a, a> of the scores (K side) and of the values (V side): a
gain below 1 is the shrinkage UFP4 (arXiv 2606.20381) attributes to E2M1's nonuniform grid -> quality.md/json/png.

perplexity: the model reads each held-out sequence through a KV cache the way a server would: a 32-token prefill,
then one token per step (each token's K/V quantised on write; decode attention over the cache); cross-entropy of
every next-token prediction -> held-out loss and perplexity per format, beside the uncached float32 forward, with
the standard error over sequences of each format's loss difference to the uncached forward and to fp4 UltraQuant
(paired: the same sequences) -> perplexity.md/json.

capacity: tokens a KV budget holds and the concurrency vLLM would report at 262K context for the spec's model (10
full-attention layers, 2 KV heads, head dim 256) at the spec's 14.5 GiB budget -> capacity.md/json.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from experiments import command, harness, plotting
from experiments.reproduce import runs

if TYPE_CHECKING:
    import jax

CONFIG = runs.config_path("quickstart")
PARTS = ("quality", "perplexity", "capacity")
STEPS = 400
PREFILL = 32
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {  # label -> (format name, options)
    "bf16": ("bf16", {}),
    "fp8": ("fp8", {}),
    "fp4 (UltraQuant: mse, K rotated)": ("fp4", {}),
    "fp4 mx, K rotated": ("fp4", {"scale_rule": "mx"}),
    "fp4 mse, no rotation": ("fp4", {"rotate_k": False}),
    "fp4 mx, no rotation": ("fp4", {"scale_rule": "mx", "rotate_k": False}),
    "fp4 mse, symmetric (K and V rotated)": ("fp4", {"rotate_v": True}),
    "fp4 mse, K rotated, fp32 query": ("fp4", {"fp8_query": False}),
    "fp4 e1m2 (uniform grid), mse, K rotated": ("fp4", {"grid": "e1m2"}),
    "fp4 e1m2 (uniform grid), mx, K rotated": ("fp4", {"grid": "e1m2", "scale_rule": "mx"}),
    "fp4 e1m2 (uniform grid), mx, no rotation": ("fp4", {"grid": "e1m2", "scale_rule": "mx", "rotate_k": False}),
    "nvfp4 (E4M3 per 16, max)": ("nvfp4", {}),
    "nvfp4 (E4M3 per 16, 4 over 6)": ("nvfp4", {"select": "4over6"}),
    "k8v4 (fp8 K, fp4 mse V)": ("k8v4", {}),
    "k8v4 (fp8 K, fp4 mx V)": ("k8v4", {"scale_rule": "mx"}),
}
ULTRAQUANT = "fp4 (UltraQuant: mse, K rotated)"


def trained_model(out: str):
    """(config, model): the quickstart MoE trained on one device for STEPS steps (trained here if needed)."""
    from experiments import load

    workdir = os.path.join(out, "runs", "model")
    runs.run_or_reuse(
        CONFIG,
        workdir,
        [
            "--config.mesh.site=1",
            "--config.mesh.data=1",
            f"--config.checkpoint.every={STEPS}",
        ],
        STEPS,
    )
    return load.trained_model(workdir)


def _fmt(label: str):
    """The KV format of a VARIANTS label."""
    from kvcache import formats

    name, options = VARIANTS[label]
    return formats.get(name, **options)


# ----------------------------------------------------------------------------------------------------- quality


def attention_error(q, k, v, fmt) -> dict[str, float]:
    """{"output": ||o_fmt - o|| / ||o|| of causal GQA attention, "scores": ||s_fmt - s|| / ||s|| of its scores q.k
    (the K side alone), "score_gain": <s_fmt, s> / <s, s>, "value_gain": <v_fmt, v> / <v, v>}; q [B, T, H, D],
    k, v [B, T, K, D] (float32)."""
    import jax
    import jax.numpy as jnp

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def scores(q, k):
        g = q.shape[2] // k.shape[2]
        return jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, g, axis=2), precision=jax.lax.Precision.HIGHEST)

    fields = fmt.quantize(k, v)
    k_hat, v_hat = fmt.dequantize(fields, rotated=True)
    q_hat = fmt.prepare_query(q)
    exact, approx = attend(q, k, v), fmt.finish_output(attend(q_hat, k_hat, v_hat))
    s, s_hat = scores(q, k), scores(q_hat, k_hat)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    gain = lambda a, b: float(jnp.vdot(a, b) / jnp.vdot(b, b))  # noqa: E731
    v_back = fmt.dequantize(fields)[1]
    return {
        "output": rel(approx, exact),
        "scores": rel(s_hat, s),
        "score_gain": gain(s_hat, s),
        "value_gain": gain(v_back, v),
    }


class RecordingCache:
    """A float32 dense cache that also keeps every layer's (q, k, v) of the forward (for `quality`)."""

    def __init__(self, inner):
        self.inner, self.records = inner, {}
        self.lengths = inner.lengths

    def update_and_attend(self, layer, q, k, v):
        """Records (q, k, v) of `layer`, then the inner cache's update and attention."""
        self.records[layer] = (q, k, v)
        out, self.inner = self.inner.update_and_attend(layer, q, k, v)
        return out, self

    def advance(self, n):
        """The inner cache advanced by `n` tokens."""
        self.inner = self.inner.advance(n)
        self.lengths = self.inner.lengths
        return self


def model_qkv(config, model) -> list[tuple]:
    """Per layer (q, k, v) of the model's forward over 8 held-out sequences (post-RoPE, float32)."""
    import jax.numpy as jnp

    from core.attention import DenseKVCache
    from experiments import build

    _, batches = build.build_data(config)
    tokens = jnp.asarray(batches.val_batches(1)[0][:, :-1])
    cfg = model.cfg
    cache = RecordingCache(
        DenseKVCache.create(
            num_layers=cfg.num_layers,
            batch=tokens.shape[0],
            capacity=tokens.shape[1],
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=jnp.float32,
        )
    )
    model(tokens, cache=cache)
    return [cache.records[i] for i in range(cfg.num_layers)]


def synthetic_qkv() -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [4, 1024, 8, 128], k and v [4, 1024, 2, 128] (float32): N(0, 1) K with channels 11 and 90 scaled x 20,
    q scaled x 0.2 (scores of order 1 on the outlier channels)."""
    import jax
    import jax.numpy as jnp

    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    d = 128
    outliers = jnp.where(jnp.isin(jnp.arange(d), jnp.asarray([11, 90])), 20.0, 1.0)
    k = jax.random.normal(kk, (4, 1024, 2, d)) * outliers
    q = jax.random.normal(kq, (4, 1024, 8, d)) * 0.2  # scores of order 1 on the outlier channels
    return q, k, jax.random.normal(kv, (4, 1024, 2, d))


def quality(study: harness.Study) -> None:
    """quality.md/json/png in `study.out`: attention-output error per format on the model's own and on synthetic
    q, k, v (the command they state: `--parts quality`)."""
    config, model = trained_model(study.out)
    layers = model_qkv(config, model)
    synthetic_inputs = synthetic_qkv()
    rows = []
    for label in VARIANTS:
        fmt = _fmt(label)
        per_layer = [attention_error(q, k, v, fmt) for q, k, v in layers]
        synthetic = attention_error(*synthetic_inputs, fmt)
        rows.append(
            {
                "format": label,
                "bytes_per_token_head_d128": fmt.bytes_per_token(1, 128),
                "model_error": float(np.mean([e["output"] for e in per_layer])),
                "model_error_per_layer": [e["output"] for e in per_layer],
                "model_score_error": float(np.mean([e["scores"] for e in per_layer])),
                "model_score_gain": float(np.mean([e["score_gain"] for e in per_layer])),
                "model_value_gain": float(np.mean([e["value_gain"] for e in per_layer])),
                "synthetic_error": synthetic["output"],
                "synthetic_score_error": synthetic["scores"],
            }
        )
        print(
            f"{label}: model {rows[-1]['model_error']:.4f} (scores {rows[-1]['model_score_error']:.4f}), "
            f"synthetic {synthetic['output']:.4f} (scores {synthetic['scores']:.4f})",
            flush=True,
        )
    study.write("quality", {"rows": rows}, quality_markdown, {"quality.png": quality_plot}, parts=["quality"])


def quality_markdown(result: dict) -> str:
    """quality.md: one row per format."""
    lines = [
        "# KV-format quality: attention-output relative error against float32",
        "",
        f"`{result['command']}`. ||o_fmt - o|| / ||o|| of causal attention "
        "over every position: the trained quickstart model's own q, k, v (8 held-out sequences x 256 tokens; "
        "mean over its 4 layers; 1 KV head of dim 64, 2 query heads), and synthetic K with 2 of 128 channels "
        "x 20 (4 x 1024 tokens, 2 KV heads, GQA 4). In brackets: the relative error of the scores q.k alone "
        "(the K side: rotation and the FP8 query act there; V's error adds to the output's). Gains on the trained "
        "model: <s_fmt, s> / <s, s> of the scores and <v_fmt, v> / <v, v> of the values (1 = no shrinkage).",
        "",
        "| format | bytes / token / head (D = 128) | trained model: output (scores) | per layer | "
        "score gain | value gain | synthetic outliers: output (scores) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        per = " / ".join(f"{e:.4f}" for e in r["model_error_per_layer"])
        lines.append(
            f"| {r['format']} | {r['bytes_per_token_head_d128']} | {r['model_error']:.4f} "
            f"({r['model_score_error']:.4f}) | {per} | {r['model_score_gain']:.4f} | {r['model_value_gain']:.4f} | "
            f"{r['synthetic_error']:.4f} ({r['synthetic_score_error']:.4f}) |"
        )
    return "\n".join(lines) + "\n"


def quality_plot(result: dict, path: str) -> None:
    """quality.png: attention-output relative error per format (log), trained model beside synthetic outliers;
    the command in the title."""
    rows = result["rows"]
    with plotting.figure(path, size=(9, 4.3), grid_axis="y", legend_size=8, title=result["command"]) as ax:
        xs = np.arange(len(rows))
        ax.bar(xs - 0.2, [r["model_error"] for r in rows], width=0.4, label="trained quickstart model")
        ax.bar(xs + 0.2, [r["synthetic_error"] for r in rows], width=0.4, label="synthetic K, outlier channels")
        ax.set_xticks(xs, [r["format"].replace(", ", ",\n").replace(" (", "\n(") for r in rows], fontsize=6)
        ax.set_yscale("log")
        ax.set_ylabel("attention-output relative error")
        ax.set_title("KV-cache formats against float32 attention", fontsize=9)


# -------------------------------------------------------------------------------------------------- perplexity


def served_loss(model, tokens, cache_factory) -> np.ndarray:
    """Each sequence's mean next-token cross-entropy (float64 [B]) of `tokens` [B, T + 1] read through a cache: a
    PREFILL-token prefill, then one token per step (one jitted program)."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)
    inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])

    @functools.partial(jax.jit, static_argnums=0)
    def run(graphdef, state, cache):
        model = nnx.merge(graphdef, state)
        logits, _, cache = model(inputs[:, :PREFILL], cache=cache)

        def step(cache, token):
            logits, _, cache = model(token[:, None], cache=cache)
            return cache, logits[:, 0]

        _, rest = jax.lax.scan(step, cache, inputs[:, PREFILL:].T)
        logits = jnp.concatenate([logits, rest.transpose(1, 0, 2)], axis=1)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], axis=1)

    return np.asarray(run(graphdef, state, cache_factory(tokens.shape[0], tokens.shape[1] - 1)), np.float64)


def _paired_se(a: np.ndarray, b: np.ndarray) -> float:
    """Standard error of mean(a - b) over paired per-sequence values."""
    return float(np.std(a - b, ddof=1) / np.sqrt(len(a)))


def perplexity(study: harness.Study, num_batches: int = 4) -> None:
    """perplexity.md/json in `study.out`: held-out loss of the trained model read through each KV format as a
    server would, over `num_batches` held-out batches (the command they state: `--parts perplexity`)."""
    import jax
    import jax.numpy as jnp

    from core import generate
    from experiments import build
    from kvcache import paged_cache_factory

    config, model = trained_model(study.out)
    _, batches = build.build_data(config)
    val = batches.val_batches(num_batches)
    cfg = model.cfg

    def uncached(tokens):
        logits = model(jnp.asarray(tokens[:, :-1]))[0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, jnp.asarray(tokens[:, 1:])[..., None], axis=-1)[..., 0]
        return np.asarray(jnp.mean(nll, axis=1), np.float64)

    per_sequence = {"no cache (float32 forward)": np.concatenate([uncached(t) for t in val])}
    factories = {"dense float32 cache": generate.dense_cache_factory(model, jnp.float32)}
    for label in VARIANTS:
        factories[label] = paged_cache_factory(
            _fmt(label),
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            implementation="xla_split",
        )
    for label, factory in factories.items():
        harness.compiling(f"decoding through the {label} KV cache")
        per_sequence[label] = np.concatenate([served_loss(model, t, factory) for t in val])
        print(f"{label}: held-out loss {per_sequence[label].mean():.4f}", flush=True)
    base, ultra = per_sequence["no cache (float32 forward)"], per_sequence[ULTRAQUANT]
    rows: list[dict[str, Any]] = []
    for label, losses in per_sequence.items():
        loss = float(losses.mean())
        rows.append(
            {
                "format": label,
                "loss": loss,
                "perplexity": float(np.exp(loss)),
                "bits_per_byte": loss / np.log(2),
                "delta_loss": loss - float(base.mean()),
                "delta_loss_se": _paired_se(losses, base),
                "vs_ultraquant": loss - float(ultra.mean()),
                "vs_ultraquant_se": _paired_se(losses, ultra),
                "bytes_per_token_head_d128": _fmt(label).bytes_per_token(1, 128) if label in VARIANTS else None,
            }
        )
    result = {
        "rows": rows,
        "num_sequences": num_batches * val[0].shape[0],
        "seq_len": val[0].shape[1] - 1,
        "prefill": PREFILL,
    }
    study.write("perplexity", result, perplexity_markdown, parts=["perplexity"])


def perplexity_markdown(result: dict) -> str:
    """perplexity.md: one row per KV cache."""
    lines = [
        "# Held-out perplexity of the quickstart model decoding through each KV-cache format",
        "",
        f"`{result['command']}`. {result['num_sequences']} held-out "
        f"sequences x {result['seq_len']} byte-tokens, each read as a server would: a {result['prefill']}-token "
        "prefill, then one token per step, every token's K/V quantised on write (paged cache, split-KV decode "
        "in XLA). Loss = mean next-token cross-entropy (nats); perplexity per byte = exp(loss). Differences "
        f"+- their standard error over the sequences (paired); the last column against {ULTRAQUANT}.",
        "",
        "| KV cache | bytes / token / head (D = 128) | held-out loss | perplexity | bits per byte | loss - uncached | "
        "loss - fp4 UltraQuant |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        size = "" if r.get("bytes_per_token_head_d128") is None else str(r["bytes_per_token_head_d128"])
        lines.append(
            f"| {r['format']} | {size} | {r['loss']:.4f} | {r['perplexity']:.4f} | {r['bits_per_byte']:.4f} | "
            f"{r['delta_loss']:+.4f} +- {r['delta_loss_se']:.4f} | "
            f"{r['vs_ultraquant']:+.4f} +- {r['vs_ultraquant_se']:.4f} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- capacity


def capacity_table(study: harness.Study) -> None:
    """capacity.md/json in `study.out`: tokens and concurrency at the spec's KV budget per format
    (kvcache.capacity; the command they state: `--parts capacity`)."""
    from kvcache import capacity

    rows = capacity.plan(capacity.SPEC_BUDGET_BYTES, capacity.SPEC_MODEL)
    result = {
        "rows": rows,
        "memory_bytes": capacity.SPEC_BUDGET_BYTES,
        "max_model_len": capacity.SPEC_MAX_MODEL_LEN,
    }

    def markdown(result):
        table = capacity.markdown(
            result["rows"],
            title="At the spec's KV budget (262,144 tokens x 2.9 of bf16)",
            memory_bytes=result["memory_bytes"],
            shape=capacity.SPEC_MODEL,
            max_model_len=result["max_model_len"],
        )
        return f"# KV capacity of the spec's model\n\n`{result['command']}`.\n\n{table}"

    study.write("capacity", result, markdown, parts=["capacity"])


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.reproduce.kvcache", topic="kvcache")
    harness.add_parts(study.parser, PARTS)
    parts = study.parse(argv).parts
    if "capacity" in parts:
        capacity_table(study)
    if "quality" in parts:
        quality(study)
    if "perplexity" in parts:
        perplexity(study)


if __name__ == "__main__":
    command.run(main)
