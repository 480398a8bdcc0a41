"""Long-context decode: time per step against context length per KV format (bf16, fp8 and fp4 by default;
`--formats` adds nvfp4, k8v4), and the bytes each step reads against the copy bandwidth measured in the same run.

    python -m experiments.bench.decode [--contexts 1024,4096,...] [--formats bf16,fp8,fp4] [--repeats 5]
        [--out runs/bench]

One attention layer of the spec's model (kvcache.md: 2 KV heads, head dim 256; 16 query heads, so GQA 8), batch 1,
one new token per step over a paged cache (block size 16, blocks in shuffled order) holding `context` tokens,
`kvcache.decode_attention` per format, without split-KV (`implementation="xla"`: gather the sequence's blocks,
dequantise, one softmax) and with it (`"xla_split"`: partitions of `kvcache.split.partition_blocks` blocks (64;
128 for fp4) visited in turn, merged by log-sum-exp).
Reported per step: median milliseconds; KV bytes read (the stored bytes of `context` tokens: 4 D B per token and
head for bf16, 2 D + 8 for fp8, D + D / 16 for fp4, D + D / 8 for nvfp4); effective bandwidth = KV bytes / time,
against a jitted copy of a 256 MiB buffer (read + write bytes / time).

On a GPU or a TPU the device's Pallas split-KV kernel (`pallas_triton` / `pallas_tpu`) is timed too, against the
decode goal at 128K (docs/kvcache.md: fp4 at least 2.5x faster than bf16 and at least 60% of the copy bandwidth). On a
CPU Pallas runs only in its interpreter, which says nothing about speed, so it is left out. Writes decode.json,
decode.md and decode.png into `--out` (`--out results/bench` for the table docs/kvcache.md quotes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments import command, harness, plotting
from experiments.harness import interleaved_medians
from kvcache import decode_attention, formats

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 16, 2, 256, 16
FORMATS = ("bf16", "fp8", "fp4")
IMPLEMENTATIONS = ("xla", "xla_split")  # plus "pallas" on a GPU (on a CPU Pallas only interprets)
GPU_GOAL = {"context": 131072, "fp4_speedup": 2.5, "of_copy": 0.6}  # the fp4 kernel's goals on a GPU (docs/kvcache.md)
CONTEXTS = (1024, 4096, 16384, 65536, 131072, 262144)
COPY_BYTES = 256 * 2**20


def filled_pool(fmt: formats.Format, context: int) -> tuple[dict, jax.Array]:
    """A one-layer pool of `context` tokens of quantised N(0, 1) keys/values (64 distinct blocks, tiled), and a
    block table listing its blocks in a shuffled order."""
    num_blocks = -(-context // BLOCK)
    distinct = min(num_blocks, 64)
    kv = jax.random.normal(jax.random.key(0), (2, distinct * BLOCK, NUM_KV_HEADS, HEAD_DIM))
    stored = fmt.quantize(kv[0], kv[1])
    fields = {}
    for name, flat in stored.items():
        x = flat.reshape(distinct, BLOCK, *flat.shape[1:]).swapaxes(1, 2)  # [distinct, K, bs, ...]
        fields[name] = jnp.tile(x, (-(-num_blocks // distinct),) + (1,) * (x.ndim - 1))[:num_blocks]
    table = np.random.default_rng(0).permutation(num_blocks).astype(np.int32)[None]
    return fields, jnp.asarray(table)


def implementations() -> tuple[str, ...]:
    """The decode implementations timed on this backend: the XLA pair, and the device's Pallas kernel ("pallas":
    `kernel_name`) on a GPU or a TPU."""
    return IMPLEMENTATIONS + (("pallas",) if jax.default_backend() in ("gpu", "tpu") else ())


def kernel_name(impl: str) -> str:
    """The kvcache implementation a timed row's name runs: "pallas" is the backend's kernel (pallas_tpu on a TPU,
    pallas_triton elsewhere); the XLA names are themselves."""
    if impl != "pallas":
        return impl
    return "pallas_tpu" if jax.default_backend() == "tpu" else "pallas_triton"


def run(contexts: list[int], repeats: int, names: tuple[str, ...] = FORMATS) -> dict:
    """Per context: every (format, implementation) and a 256 MiB copy, timed in interleaved rounds (one call of
    each per round), so a drift of the machine's speed hits all of them and the copy bandwidth they are compared
    with is measured at the same time."""
    q = jax.random.normal(jax.random.key(1), (1, NUM_HEADS, HEAD_DIM))
    buffer = jnp.arange(COPY_BYTES // 4, dtype=jnp.float32)
    copy = jax.jit(lambda a: a + 0)
    rows: list[dict[str, Any]] = []
    copies: dict[int, float] = {}
    copy_key = ("copy", "")  # the copy, timed in the same rounds as the (format, implementation) pairs
    for context in contexts:
        seq_lens = jnp.asarray([context], jnp.int32)
        calls: dict[tuple[str, str], Callable[[], object]] = {copy_key: functools.partial(copy, buffer)}
        kv_bytes = {}
        for name in names:
            fmt = formats.get(name)
            fields, table = filled_pool(fmt, context)
            kv_bytes[name] = context * fmt.bytes_per_token(NUM_KV_HEADS, HEAD_DIM)
            for impl in implementations():
                step = jax.jit(
                    lambda q, f, t, s, fmt=fmt, impl=impl: decode_attention(
                        q, f, t, s, fmt=fmt, implementation=kernel_name(impl)
                    )
                )
                calls[name, impl] = functools.partial(step, q, fields, table, seq_lens)
        seconds = interleaved_medians(calls, repeats=repeats, warmup=1, what=f"decode at context {context:,}")
        copies[context] = 2 * COPY_BYTES / seconds.pop(copy_key)
        for (name, impl), sec in seconds.items():
            rows.append(
                {
                    "context": context,
                    "format": name,
                    "implementation": impl,
                    "ms": 1e3 * sec,
                    "kv_bytes": kv_bytes[name],
                    "gb_per_s": kv_bytes[name] / sec / 1e9,
                    "of_copy": kv_bytes[name] / sec / copies[context],
                }
            )
            print(
                f"context {context:>7,} {name:>5} {impl:>9}: {1e3 * sec:8.2f} ms, {rows[-1]['gb_per_s']:6.2f} GB/s "
                f"({100 * rows[-1]['of_copy']:.0f}% of the copy's {copies[context] / 1e9:.2f} GB/s)",
                flush=True,
            )
    return {
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK,
            "batch": 1,
        },
        "copy_gb_per_s": {str(c): b / 1e9 for c, b in copies.items()},
        "formats": list(names),
        "rows": rows,
    }


def markdown(result: dict) -> str:
    """decode.md: ms per step and effective bandwidth per context and format, the growth with context, and on a
    GPU the Pallas section."""
    rows, contexts = result["rows"], sorted({r["context"] for r in result["rows"]})
    by = {(r["context"], r["format"], r["implementation"]): r for r in rows}
    names = tuple(result.get("formats", FORMATS))
    timed_pallas = any(r["implementation"] == "pallas" for r in rows)
    lines = [
        "# Long-context decode, one attention layer",
        "",
        f"`{result['command']}`. Batch 1, {NUM_HEADS} query / "
        f"{NUM_KV_HEADS} KV heads, head dim {HEAD_DIM}, block size {BLOCK}; ms per decode step without split-KV "
        "(`xla`) and with it (`xla_split`), and the split path's stored-KV bytes read per second against the "
        "bandwidth of a 256 MiB copy (read + write) timed in the same interleaved rounds. "
        + (
            "The Pallas kernel is timed below."
            if timed_pallas
            else "The Pallas kernels are not timed: on a CPU they run only in Pallas' interpreter."
        ),
        "",
        "| context | "
        + " | ".join(f"{f} ms (no split / split) | {f} GB/s (of copy)" for f in names)
        + " | fp4 / bf16 time (split) | copy GB/s |",
        "|---|" + "---|---|" * len(names) + "---|---|",
    ]
    for c in contexts:
        cells = [
            f"{by[c, f, 'xla']['ms']:.2f} / {by[c, f, 'xla_split']['ms']:.2f} | "
            f"{by[c, f, 'xla_split']['gb_per_s']:.2f} ({100 * by[c, f, 'xla_split']['of_copy']:.0f}%)"
            for f in names
        ]
        ratio = by[c, "fp4", "xla_split"]["ms"] / by[c, "bf16", "xla_split"]["ms"]
        lines.append(f"| {c:,} | " + " | ".join(cells) + f" | {ratio:.2f}x | {result['copy_gb_per_s'][str(c)]:.2f} |")
    if len(contexts) > 1:
        first, last = contexts[1 if len(contexts) > 2 else 0], contexts[-1]
        lines += [
            "",
            f"Time growth from {first:,} to {last:,} tokens divided by the context growth (1.00 = linear, "
            "> 1 = a cliff):",
        ]
        for impl in IMPLEMENTATIONS:
            growth = {f: (by[last, f, impl]["ms"] / by[first, f, impl]["ms"]) / (last / first) for f in names}
            lines.append(f"- {impl}: " + ", ".join(f"{f} {g:.2f}" for f, g in growth.items()))
    if timed_pallas:
        lines += pallas_markdown(by, contexts, names)
    return "\n".join(lines) + "\n"


def pallas_markdown(by: dict, contexts: list[int], names: tuple[str, ...] = FORMATS) -> list[str]:
    """The Pallas split-KV decode kernel per format, and the GPU goals for fp4 (GPU_GOAL)."""
    lines = [
        "",
        "Pallas split-KV decode kernel (compiled, not interpreted):",
        "",
        "| context | " + " | ".join(f"{f} ms (GB/s, of copy)" for f in names) + " | bf16 / fp4 time |",
        "|---|" + "---|" * len(names) + "---|",
    ]
    for c in contexts:
        cells = [
            f"{by[c, f, 'pallas']['ms']:.3f} ({by[c, f, 'pallas']['gb_per_s']:.0f}, "
            f"{100 * by[c, f, 'pallas']['of_copy']:.0f}%)"
            for f in names
        ]
        ratio = by[c, "bf16", "pallas"]["ms"] / by[c, "fp4", "pallas"]["ms"]
        lines.append(f"| {c:,} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    c = int(GPU_GOAL["context"])
    if (c, "fp4", "pallas") in by:
        speedup = by[c, "bf16", "pallas"]["ms"] / by[c, "fp4", "pallas"]["ms"]
        of_copy = by[c, "fp4", "pallas"]["of_copy"]
        met = speedup >= GPU_GOAL["fp4_speedup"] and of_copy >= GPU_GOAL["of_copy"]
        lines += [
            "",
            f"Goal at {c:,} tokens: fp4 at least {GPU_GOAL['fp4_speedup']}x faster than bf16 and at least "
            f"{GPU_GOAL['of_copy']:.0%} of the copy bandwidth: measured {speedup:.2f}x and {of_copy:.0%} "
            f"({'met' if met else 'missed'}).",
        ]
    return lines


def plot(result: dict, path: str) -> None:
    """decode.png: ms per step against context (log-log) and the split paths' bandwidth against the copy's; colour
    = KV format, line style = implementation, one legend under both panels; the command in the title."""
    names = tuple(result.get("formats", FORMATS))
    color = plotting.colors(names)
    styles = dict(zip(IMPLEMENTATIONS + ("pallas",), ("--", "-", ":")))
    m = result["machine"]
    title = f"{result['command']}  ({m['device']}, {m['cpu_count']} cores)"
    with plotting.figure(path, size=(11, 4.4), ncols=2, legend_below=True, legend_columns=8, title=title) as axes:
        ax1, ax2 = axes
        drawn = set()
        for f in names:
            for impl, style in styles.items():
                rs = [r for r in result["rows"] if r["format"] == f and r["implementation"] == impl]
                if not rs:
                    continue
                drawn.add(impl)
                xs = [r["context"] for r in rs]
                ax1.loglog(xs, [r["ms"] for r in rs], "o" + style, color=color[f], ms=4)
                if impl != "xla":
                    ax2.semilogx(xs, [r["gb_per_s"] for r in rs], "o" + style, color=color[f], ms=4)
        for f in names:  # the legend: colour = format, line style = implementation
            ax1.plot([], [], "o", color=color[f], label=f"{f} KV")
        for impl in (i for i in styles if i in drawn):
            ax1.plot([], [], styles[impl], color="gray", label=f"{impl} ({styles[impl]})")
        copies = sorted((int(c), b) for c, b in result["copy_gb_per_s"].items())
        ax2.semilogx([c for c, _ in copies], [b for _, b in copies], "k-.", lw=1, label="256 MiB copy (read + write)")
        ax1.set_xlabel("context (tokens)")
        ax1.set_ylabel("ms per decode step")
        ax1.set_title("Decode time against context, one attention layer, batch 1", fontsize=9)
        ax2.set_xlabel("context (tokens)")
        ax2.set_ylabel("stored KV bytes read / time (GB/s)")
        ax2.set_title("Effective bandwidth of split-KV decode against a copy's", fontsize=9)
        ax2.set_ylim(bottom=0)


def _format_names(text: str) -> tuple[str, ...]:
    """--formats: comma-separated names of kvcache.formats, bf16 and fp4 among them (the ratios compare them)."""
    import argparse

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in formats.NAMES]
    if unknown or not {"bf16", "fp4"} <= set(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown {unknown} or without bf16 and fp4; allowed: names from {list(formats.NAMES)}, "
            "bf16 and fp4 among them"
        )
    return names


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.bench.decode", topic="bench", repeats=5)
    parser = study.parser
    parser.add_argument(
        "--contexts",
        type=harness.integers(1),
        default=",".join(map(str, CONTEXTS)),
        help="context lengths to time, in tokens: comma-separated integers >= 1",
    )
    parser.add_argument(
        "--formats",
        type=_format_names,
        default=",".join(FORMATS),
        help=f"KV formats to time, comma-separated, with bf16 and fp4 among them; allowed: {','.join(formats.NAMES)}",
    )
    args = study.parse(argv)
    study.write("decode", run(args.contexts, args.repeats, args.formats), markdown, {"decode.png": plot})


if __name__ == "__main__":
    command.run(main)
