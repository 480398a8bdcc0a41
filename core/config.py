"""Experiment configuration: declared fields, defaults, and validation before anything compiles.

A configuration is an `ml_collections.ConfigDict` with one sub-dict per section (`model`, `data`, `optim`,
`train`, `mesh`, `checkpoint`, `sample`). Every leaf is declared once as a `Field`: its default, the Python
types it accepts, its allowed choices or range, and one line of documentation. From that single declaration we
derive the default ConfigDict (`defaults`), the reference table in docs/configuration.md (`describe`), and
the checks of `validate`:

  * an unknown key (a typo such as `model.dmodel`) -> error naming the key and the closest known keys;
  * a wrong type (`train.steps = "300"`)           -> error naming the key, the value and the accepted types;
  * a value outside its choices or range           -> error naming the key, the value and what is allowed;
  * an impossible combination (heads not dividing d_model, a mesh larger than the devices, a batch the data
    axis cannot split, ...)                        -> error naming every key involved.

Other packages declare their own sections the same way (a `dict[str, Field]`); the composition root
(`experiments/build.py`) adds them to `schema()` and fills registered choices (e.g. `optim.name`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any

import ml_collections

__all__ = [
    "MESH_AXES",
    "ConfigError",
    "Field",
    "Schema",
    "defaults",
    "describe",
    "mesh_axes",
    "mesh_shape",
    "rule_mesh_axes",
    "schema",
    "unknown_key_error",
    "validate",
]


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or impossible. The message names the key and what is allowed."""


@dataclasses.dataclass(frozen=True)
class Field:
    """One configuration leaf.

    Attributes:
      default: the default value (must itself pass the checks below).
      types: accepted Python types. `float` fields also accept `int`; `bool` is never accepted as an `int`.
      doc: one line for docs/configuration.md.
      choices: allowed values, or None.
      low, high: inclusive bounds for numbers, or None.
      low_open: if True, `low` itself is excluded (value > low).
    """

    default: Any
    types: tuple[type, ...]
    doc: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def check(self, key: str, value: Any) -> None:
        """Raises ConfigError if `value` is not an acceptable value for `key`."""
        if not _has_type(value, self.types):
            raise ConfigError(
                f"config key '{key}' = {value!r} has type {type(value).__name__}; "
                f"expected {' or '.join(t.__name__ for t in self.types)}."
            )
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"config key '{key}' = {value!r} is not one of the allowed values {list(self.choices)}.")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"config key '{key}' = {value!r} must be a finite number.")
            too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
            too_high = self.high is not None and value > self.high
            if too_low or too_high:
                raise ConfigError(f"config key '{key}' = {value!r} is outside the allowed range {self._range()}.")

    def _range(self) -> str:
        lo = "(-inf" if self.low is None else ("(" if self.low_open else "[") + f"{self.low:g}"
        hi = "inf)" if self.high is None else f"{self.high:g}]"
        return f"{lo}, {hi}"

    def describe(self) -> str:
        """What is allowed, in words (for docs)."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        kinds = " or ".join(t.__name__ for t in self.types)
        if self.low is not None or self.high is not None:
            return f"{kinds} in {self._range()}"
        return kinds


def _has_type(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    if float in types and isinstance(value, int):
        return True
    if tuple in types and isinstance(value, list):  # ConfigDict and CLI parsing may turn tuples into lists
        return True
    return isinstance(value, types)


def _int(default, doc, low=None, high=None):
    return Field(default, (int,), doc, low=low, high=high)


def _float(default, doc, low=None, high=None, low_open=False):
    return Field(default, (float,), doc, low=low, high=high, low_open=low_open)


def _str(default, doc, choices=None):
    return Field(default, (str,), doc, choices=choices)


def _bool(default, doc):
    return Field(default, (bool,), doc)


Schema = dict[str, dict[str, Field]]
"""section name -> key -> Field."""

# Logical axis -> mesh axes. Parameters and activations name their dimensions with the logical axes on the left;
# a rule maps each to zero, one or several mesh axes (a tuple shards the dimension over their product).
DEFAULT_RULES = (
    ("batch", ("site", "data", "expert")),
    ("seq", None),
    ("embed", None),
    ("vocab", "model"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("mlp", "model"),
    ("expert", "expert"),
)


def schema() -> Schema:
    """The core sections. Returns a fresh nested dict (callers may extend it)."""
    return {
        "model": {
            "vocab_size": _int(
                264,
                "embedding rows; >= the tokenizer's 259 (bytes + PAD/BOS/EOS), a multiple of 8 keeps matmuls aligned",
                low=1,
            ),
            "d_model": _int(256, "residual stream width", low=1),
            "num_layers": _int(4, "transformer blocks", low=1),
            "num_heads": _int(8, "query heads; must divide d_model", low=1),
            "num_kv_heads": _int(8, "key/value heads (grouped-query attention); must divide num_heads", low=1),
            "d_ff": _int(1024, "hidden width of the dense MLP", low=1),
            "mlp": _str(
                "swiglu", "dense MLP form: 'swiglu' (SiLU-gated, 3 matrices) or 'silu' (2 matrices)", ("swiglu", "silu")
            ),
            "norm": _str("rmsnorm", "normalisation layer", ("rmsnorm", "layernorm")),
            "norm_eps": _float(1e-6, "epsilon inside the norm", low=0.0, low_open=True),
            "peri_ln": _bool(False, "Peri-LN: also normalise each sublayer's output before the residual add"),
            "rope_theta": _float(10_000.0, "RoPE base frequency", low=1.0),
            "tie_embeddings": _bool(True, "share the token embedding with the output head"),
            "init_std": _float(
                0.02,
                "std of the normal initialiser (output projections are scaled by 1/sqrt(2 num_layers))",
                low=0.0,
                low_open=True,
            ),
            "dtype": _str("float32", "activation / matmul dtype", ("float32", "bfloat16")),
            "param_dtype": _str("float32", "parameter storage dtype", ("float32", "bfloat16")),
            "attention_impl": _str("xla", "jax.nn.dot_product_attention backend for training", ("xla", "cudnn")),
        },
        "data": {
            "path": _str(
                "",
                "'': the built-in corpus (the Python standard library's "
                "sources); else a .txt/.md/.jsonl file, a directory or a glob",
            ),
            "jsonl_field": _str("text", "string field holding a document in .jsonl files"),
            "val_fraction": _float(
                0.02, "fraction of documents held out for evaluation", low=0.0, high=0.5, low_open=True
            ),
            "seq_len": _int(256, "tokens per training sequence", low=1),
            "batch_size": _int(32, "global batch (sequences per step, over all processes)", low=1),
            "seed": _int(0, "seed of the batch sampler (batches are a pure function of seed and step)", low=0),
        },
        "optim": {
            "name": _str("adamw", "optimizer", ("adamw",)),
            "learning_rate": _float(3e-3, "peak learning rate", low=0.0),
            "warmup_steps": _int(100, "linear warm-up steps from 0 to the peak", low=0),
            "schedule": _str("cosine", "decay after warm-up", ("cosine", "constant", "linear")),
            "min_lr_ratio": _float(0.1, "final learning rate as a fraction of the peak", low=0.0, high=1.0),
            "b1": _float(0.9, "first-moment decay", low=0.0, high=1.0),
            "b2": _float(0.95, "second-moment decay", low=0.0, high=1.0),
            "eps": _float(1e-8, "denominator epsilon", low=0.0),
            "weight_decay": _float(
                0.1, "decoupled weight decay (matrices only; not norms, biases, embeddings)", low=0.0
            ),
            "grad_clip_norm": _float(1.0, "clip the global gradient norm to this (0 disables)", low=0.0),
        },
        "train": {
            "steps": _int(1000, "optimizer steps", low=1),
            "seed": _int(0, "seed of parameter initialisation and per-step randomness", low=0),
            "log_every": _int(10, "steps between train-metric rows in metrics.jsonl", low=1),
            "eval_every": _int(200, "steps between evaluations (and always at the last step)", low=1),
            "eval_batches": _int(8, "held-out batches per evaluation", low=1),
            "progress": _bool(True, "show a progress bar"),
        },
        "mesh": {
            "site": _int(1, "mesh axis 'site' size (federated sites); -1 = all remaining devices", low=-1),
            "data": _int(-1, "mesh axis 'data' size (data parallel); -1 = all remaining devices", low=-1),
            "expert": _int(1, "mesh axis 'expert' size (expert parallel); -1 = all remaining devices", low=-1),
            "model": _int(1, "mesh axis 'model' size (tensor parallel); -1 = all remaining devices", low=-1),
            "rules": Field(
                DEFAULT_RULES,
                (tuple,),
                "logical axis -> mesh axis rules: ((logical, mesh axis | tuple of mesh axes | None), ...)",
            ),
            "num_processes": _int(1, "processes in a multi-process run (jax.distributed)", low=1),
            "process_id": _int(0, "this process's index in a multi-process run", low=0),
            "coordinator_address": _str("", "host:port of process 0 in a multi-process run"),
        },
        "checkpoint": {
            "every": _int(
                100,
                "steps between checkpoints (the last step is always saved); 0 = only the last; "
                "federated runs save after every round",
                low=0,
            ),
            "keep": _int(2, "checkpoints kept on disk", low=1),
            "resume": _bool(True, "resume from the latest checkpoint in the workdir if there is one"),
            "async_save": _bool(False, "write checkpoints in a background thread"),
        },
        "sample": {
            "prompt": _str("def ", "prompt for the sample printed after training ('' = no sample)"),
            "num_tokens": _int(200, "tokens to generate", low=0),
            "temperature": _float(0.7, "sampling temperature (0 = greedy)", low=0.0),
            "top_k": _int(0, "sample from the k most likely tokens (0 = all)", low=0),
        },
    }


def defaults(spec: Schema | None = None) -> ml_collections.ConfigDict:
    """The default ConfigDict of a schema (the core schema by default)."""
    spec = schema() if spec is None else spec
    return ml_collections.ConfigDict(
        {section: {key: f.default for key, f in fields.items()} for section, fields in spec.items()}
    )


def unknown_key_error(key: str, known: list[str]) -> ConfigError:
    """The error for an unknown key, suggesting the closest known keys."""
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return ConfigError(f"unknown config key '{key}'.{hint} Known keys: {', '.join(sorted(known))}.")


def validate(
    config: ml_collections.ConfigDict,
    spec: Schema | None = None,
    *,
    num_devices: int | None = None,
) -> None:
    """Checks every key, type, value and cross-field constraint; raises ConfigError on the first problem.

    Args:
      config: the experiment configuration.
      spec: the schema to check against (default: the core schema).
      num_devices: if given, the mesh is also checked against this number of devices.
    """
    spec = schema() if spec is None else spec
    if not isinstance(config, (ml_collections.ConfigDict, Mapping)):
        raise ConfigError(f"a config must be an ml_collections.ConfigDict, got {type(config).__name__}.")
    for section in config:
        if section not in spec:
            raise unknown_key_error(section, list(spec))
        sub = config[section]
        if not isinstance(sub, (ml_collections.ConfigDict, Mapping)):
            raise ConfigError(f"config key '{section}' must be a section (ConfigDict), got {sub!r}.")
        for key in sub:
            full = f"{section}.{key}"
            if key not in spec[section]:
                raise unknown_key_error(full, [f"{section}.{k}" for k in spec[section]])
            spec[section][key].check(full, sub[key])
    for section, fields in spec.items():
        for key in fields:
            if section not in config or key not in config[section]:
                raise ConfigError(
                    f"config key '{section}.{key}' is missing; start from a default config "
                    f"(core.config.defaults or experiments.build.default_config)."
                )
    _check_core(config, num_devices)


def _mesh_shape(mesh_cfg, num_devices: int | None) -> dict[str, int]:
    """Resolves the -1 entries of the mesh section. Needs `num_devices` if any axis is -1."""
    sizes = {axis: int(mesh_cfg[axis]) for axis in MESH_AXES}
    for axis, size in sizes.items():
        if size == 0:
            raise ConfigError(f"config key 'mesh.{axis}' = 0; a mesh axis has size >= 1, or -1 for the rest.")
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ConfigError(
            f"config keys {', '.join('mesh.' + a for a in free)} are all -1; at most one mesh "
            "axis may take the remaining devices."
        )
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if num_devices is None:
        return sizes
    if free:
        if num_devices % fixed:
            raise ConfigError(
                f"config key 'mesh.{free[0]}' = -1 cannot take the remaining devices: the other "
                f"axes use {fixed} and {num_devices} devices are not a multiple of that."
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed > num_devices:
        raise ConfigError(
            f"the mesh {sizes} needs {fixed} devices but only {num_devices} are available; "
            "lower mesh.site/data/expert/model."
        )
    return sizes


MESH_AXES = ("site", "data", "expert", "model")
"""Mesh axis names, outermost first (slow links outermost: sites, then data, expert and model parallelism)."""


def mesh_shape(config: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """The mesh axis sizes {axis: size} with -1 resolved against `num_devices`."""
    return _mesh_shape(config.mesh, num_devices)


def mesh_axes(target) -> tuple[str, ...]:
    """A rule's target (or a PartitionSpec entry) as a tuple of mesh axes: None -> (), "data" -> ("data",)."""
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


def rule_mesh_axes(rules, logical: str) -> tuple[str, ...]:
    """The mesh axes `rules` map the logical axis `logical` to (() when it is replicated)."""
    return mesh_axes(dict(rules).get(logical))


def _check_core(config: ml_collections.ConfigDict, num_devices: int | None) -> None:
    m = config.model
    if m.d_model % m.num_heads:
        raise ConfigError(
            f"config key 'model.num_heads' = {m.num_heads} must divide 'model.d_model' = "
            f"{m.d_model} (head dim = d_model / num_heads)."
        )
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"config key 'model.num_kv_heads' = {m.num_kv_heads} must divide 'model.num_heads' = "
            f"{m.num_heads} (each KV head serves num_heads / num_kv_heads query heads)."
        )
    if (m.d_model // m.num_heads) % 2:
        raise ConfigError(
            f"head dim d_model / num_heads = {m.d_model // m.num_heads} (model.d_model = "
            f"{m.d_model}, model.num_heads = {m.num_heads}) must be even for RoPE."
        )
    if m.vocab_size < 259:
        raise ConfigError(
            f"config key 'model.vocab_size' = {m.vocab_size} is smaller than the byte "
            "tokenizer's 259 ids (256 bytes + PAD, BOS, EOS)."
        )
    o = config.optim
    if o.warmup_steps > config.train.steps:
        raise ConfigError(
            f"config key 'optim.warmup_steps' = {o.warmup_steps} exceeds 'train.steps' = {config.train.steps}."
        )
    mesh = config.mesh
    if mesh.process_id >= mesh.num_processes:
        raise ConfigError(
            f"config key 'mesh.process_id' = {mesh.process_id} must be < 'mesh.num_processes' = {mesh.num_processes}."
        )
    if mesh.num_processes > 1 and not mesh.coordinator_address:
        raise ConfigError(
            f"config key 'mesh.coordinator_address' is empty but 'mesh.num_processes' = "
            f"{mesh.num_processes}; give host:port of process 0 (e.g. 127.0.0.1:12355)."
        )
    if config.data.batch_size % mesh.num_processes:
        raise ConfigError(
            f"config key 'data.batch_size' = {config.data.batch_size} must be divisible by "
            f"'mesh.num_processes' = {mesh.num_processes}."
        )
    _check_rules(mesh.rules)
    sizes = _mesh_shape(mesh, num_devices)
    if num_devices is not None:
        batch_axes = rule_mesh_axes(mesh.rules, "batch")
        batch_shards = math.prod(sizes[a] for a in batch_axes)
        if config.data.batch_size % batch_shards:
            raise ConfigError(
                f"config key 'data.batch_size' = {config.data.batch_size} must be divisible by "
                f"{' x '.join('mesh.' + a for a in batch_axes)} = {batch_shards} (mesh.rules "
                "splits the batch over them)."
            )
        for key, axis_size, what in (
            ("num_heads", sizes["model"], "model"),
            ("num_kv_heads", sizes["model"], "model"),
            ("d_ff", sizes["model"], "model"),
        ):
            if m[key] % axis_size:
                raise ConfigError(
                    f"config key 'model.{key}' = {m[key]} must be divisible by the mesh axis "
                    f"'{what}' = {axis_size} (mesh.{what}), which shards it."
                )


def _check_rules(rules: Any) -> None:
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ConfigError(
                f"config key 'mesh.rules'[{i}] = {rule!r}; each rule is (logical axis name, "
                "mesh axis | tuple of mesh axes | None)."
            )
        for t in mesh_axes(rule[1]):
            if t not in MESH_AXES:
                raise ConfigError(
                    f"config key 'mesh.rules'[{i}] = {tuple(rule)!r} names mesh axis {t!r}; "
                    f"mesh axes are {list(MESH_AXES)}."
                )
    names = [r[0] for r in rules]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ConfigError(f"config key 'mesh.rules' maps the logical axes {dups} more than once.")


def describe(spec: Schema | None = None) -> str:
    """A markdown reference of every key: default, what is allowed, meaning."""
    spec = schema() if spec is None else spec
    lines = []
    for section, fields in spec.items():
        lines += [f"## `{section}`", "", "| key | default | allowed | meaning |", "|---|---|---|---|"]
        for key, f in fields.items():
            allowed = f.describe().replace("|", "\\|")
            lines.append(f"| `{section}.{key}` | `{f.default!r}` | {allowed} | {f.doc.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)
