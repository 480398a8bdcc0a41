"""Experiment configuration: declared fields, defaults, and validation before anything compiles.

A configuration is an `ml_collections.ConfigDict` with one sub-dict per section (`model`, `data`, `optim`,
`train`, `mesh`, `checkpoint`, `sample`, and the sections other packages add). Each section is declared once, as a
frozen dataclass whose fields are declared with `field`: the default, the accepted types (from the annotation),
the allowed choices or range, and one line of documentation; its class variable `compat` says which of its keys a
checkpoint must share to be resumed, and `provenance` which others describe how the weights were trained (a resume
may change them only when told to, `checkpoint.accept_changes`). Code reads a section as that dataclass
(`from_config`); from the same declaration we derive the default ConfigDict (`defaults`), the reference table in
docs/configuration.md (`describe`), the resume facts (`checkpoint_compat`, `provenance`) and the checks of
`validate`:

  * an unknown key (a typo such as `model.dmodel`) -> error naming the key and the closest known keys;
  * a wrong type (`train.steps = "300"`)           -> error naming the key, the value and the accepted types;
  * a value outside its choices or range           -> error naming the key, the value and what is allowed;
  * an impossible combination (heads not dividing d_model, a mesh larger than the devices, a batch the data
    axis cannot split, ...)                        -> error naming every key involved.

The command line fits a warm-up longer than a short run to the run's length before validating (`fit_to_steps`).

Other packages declare their own sections the same way (moe.config, quant.config, kvcache.config, optim.config);
the composition root (`experiments/build.py`) adds them to `SECTIONS` and fills registered choices (`optim.name`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

import ml_collections

from core import tokenizer as tokenizer_lib

__all__ = [
    "DEFAULT_RULES",
    "FROM_CLUSTER",
    "MESH_AXES",
    "SECTIONS",
    "CheckpointConfig",
    "Compat",
    "ConfigError",
    "DataConfig",
    "Field",
    "MeshConfig",
    "OptimConfig",
    "SampleConfig",
    "Schema",
    "TrainConfig",
    "TransformerConfig",
    "check_processes",
    "checkpoint_compat",
    "defaults",
    "describe",
    "field",
    "fit_to_steps",
    "from_config",
    "mesh_axes",
    "mesh_shape",
    "provenance",
    "rule_mesh_axes",
    "schema",
    "section_fields",
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
                f"config key '{key}' = {value!r} has type {type(value).__name__}; expected {_names(self.types)}."
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
        kinds = _names(tuple(t for t in self.types if t is not type(None)))
        if self.low is not None or self.high is not None:
            kinds = f"{kinds} in {self._range()}"
        return f"{kinds} or None" if type(None) in self.types else kinds


def _names(accepted: tuple[type, ...]) -> str:
    return " or ".join("None" if t is type(None) else t.__name__ for t in accepted)


def _has_type(value: Any, accepted: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in accepted
    if float in accepted and isinstance(value, int):
        return True
    if tuple in accepted and isinstance(value, list):  # ConfigDict and CLI parsing may turn tuples into lists
        return True
    return isinstance(value, accepted)


def field(
    default: Any,
    doc: str,
    *,
    choices: tuple[Any, ...] | None = None,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> Any:
    """Declares one key of a config section: a dataclass field whose metadata holds its documentation and rules.

    The accepted types come from the field's annotation (`int`, `float`, `str`, `bool`, `tuple[...]`, or one of
    them `| None`), so a section is declared once, as a frozen dataclass:

        @dataclasses.dataclass(frozen=True)
        class TrainConfig:
            compat: ClassVar[Compat] = False
            steps: int = field(1000, "optimizer steps", low=1)
    """
    rules = {"doc": doc, "choices": choices, "low": low, "high": high, "low_open": low_open}
    return dataclasses.field(default=default, metadata={_RULES: rules})


_RULES = "core.config"  # the metadata key of a field's rules

Compat = bool | tuple[str, ...]
"""How a section takes part in resume compatibility (`checkpoint_compat`): True, every key must equal the
checkpoint's; False, none (runtime choices: the mesh, cadences, the sampling prompt); a tuple names the keys that
must (the optimizer's `name`, but not its learning rate). The same values declare `provenance`: the keys that
describe how the weights were trained (True: every key `compat` does not name)."""

_SCALARS: dict[Any, tuple[type, ...]] = {int: (int,), float: (float,), str: (str,), bool: (bool,), tuple: (tuple,)}


def _types(annotation: Any, where: str) -> tuple[type, ...]:
    """The Python types a field's annotation accepts: int, float, str, bool, tuple[...], or one of them | None."""
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is tuple:
        return (tuple,)
    if origin in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        return (*_types(inner, where), type(None))
    raise TypeError(
        f"{where}: config fields are int, float, str, bool, tuple[...] or one of them | None; got {annotation!r}."
    )


def section_fields(section: type) -> dict[str, Field]:
    """key -> Field of a section dataclass (each key declared with `field`), in declaration order."""
    hints = typing.get_type_hints(section)
    out = {}
    for f in dataclasses.fields(section):
        if _RULES not in f.metadata:
            raise TypeError(f"{section.__name__}.{f.name} is not declared with core.config.field(...).")
        out[f.name] = Field(f.default, _types(hints[f.name], f"{section.__name__}.{f.name}"), **f.metadata[_RULES])
    return out


_S = typing.TypeVar("_S")


def from_config(section: type[_S], values: Mapping[str, Any]) -> _S:
    """The section dataclass holding a config section's values (lists become tuples: ConfigDict and the command
    line may turn tuples into lists). Raises ConfigError naming a key the section does not declare."""
    items = values.to_dict() if isinstance(values, ml_collections.ConfigDict) else dict(values)
    known = [f.name for f in dataclasses.fields(section)]  # type: ignore[arg-type]
    for key in items:
        if key not in known:
            raise unknown_key_error(key, known)
    return section(**{k: _tuples(v) for k, v in items.items()})


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


Schema = dict[str, dict[str, Field]]
"""section name -> key -> Field (what `validate`, `defaults` and `describe` read)."""

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

_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The section `model`: the transformer's hyper-parameters (core.model.Transformer)."""

    compat: ClassVar[Compat] = True

    vocab_size: int = field(
        264,
        "embedding rows; >= the tokenizer's vocab_size (data.tokenizer; bytes: 259 = 256 bytes + PAD/BOS/EOS), a "
        "multiple of 8 keeps matmuls aligned",
        low=1,
    )
    d_model: int = field(256, "residual stream width", low=1)
    num_layers: int = field(4, "transformer blocks", low=1)
    num_heads: int = field(8, "query heads; must divide d_model unless head_dim is set", low=1)
    num_kv_heads: int = field(8, "key/value heads (grouped-query attention); must divide num_heads", low=1)
    head_dim: int = field(0, "width of each query/key/value head (even); 0 = d_model / num_heads", low=0)
    qkv_bias: bool = field(False, "biases on the query, key and value projections (Qwen2)")
    out_bias: bool = field(False, "a bias on the attention output projection")
    qk_norm: bool = field(False, "RMSNorm over each query and key head before RoPE, a learned scale per dim (Qwen3)")
    d_ff: int = field(1024, "hidden width of the dense MLP", low=1)
    mlp: str = field(
        "swiglu",
        "dense MLP form: 'swiglu' (SiLU-gated, 3 matrices) or 'silu' (2 matrices)",
        choices=("swiglu", "silu"),
    )
    norm: str = field("rmsnorm", "normalisation layer", choices=("rmsnorm", "layernorm"))
    norm_eps: float = field(1e-6, "epsilon inside the norm", low=0.0, low_open=True)
    peri_ln: bool = field(False, "Peri-LN: also normalise each sublayer's output before the residual add")
    rope_theta: float = field(10_000.0, "RoPE base frequency", low=1.0)
    rope_scaling: str = field(
        "none",
        "RoPE frequency scaling: 'none' or 'llama3' (Llama 3.1: wavelengths past original_max_len / "
        "low_freq_factor divided by factor, below original_max_len / high_freq_factor kept, smooth between)",
        choices=("none", "llama3"),
    )
    rope_factor: float = field(8.0, "rope_scaling 'llama3': the factor long wavelengths are divided by", low=1.0)
    rope_low_freq_factor: float = field(1.0, "rope_scaling 'llama3': low_freq_factor", low=0.0, low_open=True)
    rope_high_freq_factor: float = field(4.0, "rope_scaling 'llama3': high_freq_factor", low=0.0, low_open=True)
    rope_original_max_len: int = field(
        8192, "rope_scaling 'llama3': the context length the frequencies were trained for", low=1
    )
    tie_embeddings: bool = field(True, "share the token embedding with the output head")
    init_std: float = field(
        0.02,
        "std of the normal initialiser (output projections are scaled by 1/sqrt(2 num_layers))",
        low=0.0,
        low_open=True,
    )
    dtype: str = field("float32", "activation / matmul dtype", choices=_DTYPES)
    param_dtype: str = field("float32", "parameter storage dtype", choices=_DTYPES)
    attention_impl: str = field("xla", "jax.nn.dot_product_attention backend for training", choices=("xla", "cudnn"))

    def __post_init__(self) -> None:
        if self.head_dim == 0:  # resolved once, so that code reads cfg.head_dim whether it was set or derived
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)

    @property
    def compute_dtype(self) -> Any:
        """`dtype` as a JAX dtype."""
        import jax.numpy as jnp  # the config module imports JAX only once a model is built

        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> Any:
        """`param_dtype` as a JAX dtype."""
        import jax.numpy as jnp

        return jnp.dtype(self.param_dtype)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The section `data`: the corpus and its batches (core.data). The corpus itself takes part in resume
    compatibility through its fingerprint."""

    compat: ClassVar[Compat] = ("seq_len", "batch_size")
    # the corpus itself is compared by its fingerprint (which holds the tokenizer's digest unless it is bytes)
    provenance: ClassVar[Compat] = ("seed", "tokenizer")

    path: str = field(
        "",
        "'': the built-in corpus (the Python standard library's sources); else a .txt/.md/.jsonl file, a "
        "directory or a glob",
    )
    jsonl_field: str = field("text", "string field holding a document in .jsonl files")
    val_fraction: float = field(0.02, "fraction of documents held out for evaluation", low=0.0, high=0.5, low_open=True)
    seq_len: int = field(256, "tokens per training sequence", low=1)
    batch_size: int = field(32, "global batch (sequences per step, over all processes)", low=1)
    seed: int = field(0, "seed of the batch sampler (batches are a pure function of seed and step)", low=0)
    tokenizer: str = field(
        "bytes",
        "'bytes' (ids 0-255 = bytes, PAD/BOS/EOS 256-258); else the path (from the working directory) of a Hugging "
        "Face byte-level BPE tokenizer.json or of a directory holding one (`python -m experiments.tokenizer train` "
        "makes one; a document that is not UTF-8 is read with U+FFFD for its invalid bytes)",
    )


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The section `optim`: which optimizer, its learning-rate schedule and clipping (core.train). Optimizer
    families add their own keys by subclassing (optim.config); the composition root registers the names."""

    compat: ClassVar[Compat] = ("name",)
    provenance: ClassVar[Compat] = True

    name: str = field("adamw", "optimizer", choices=("adamw",))
    learning_rate: float = field(3e-3, "peak learning rate", low=0.0)
    warmup_steps: int = field(
        100,
        "linear warm-up steps from 0 to the peak; the command line lowers a warm-up longer than train.steps to "
        "train.steps (with a notice)",
        low=0,
    )
    schedule: str = field("cosine", "decay after warm-up", choices=("cosine", "constant", "linear"))
    min_lr_ratio: float = field(0.1, "final learning rate as a fraction of the peak", low=0.0, high=1.0)
    weight_decay: float = field(0.1, "decoupled weight decay (matrices only; not norms, biases, embeddings)", low=0.0)
    grad_clip_norm: float = field(1.0, "clip the global gradient norm to this (0 disables)", low=0.0)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The section `train`: the length, seed and cadences of the training loop (core.train)."""

    compat: ClassVar[Compat] = False
    provenance: ClassVar[Compat] = ("steps", "seed")

    steps: int = field(1000, "optimizer steps", low=1)
    seed: int = field(0, "seed of parameter initialisation and per-step randomness", low=0)
    log_every: int = field(10, "steps between train-metric rows in metrics.jsonl", low=1)
    eval_every: int = field(200, "steps between evaluations (and always at the last step)", low=1)
    eval_batches: int = field(8, "held-out batches per evaluation", low=1)
    progress: bool = field(
        True, "show progress: a bar where stderr is a terminal, else a plain line every tenth of the run or minute"
    )
    tensorboard: bool = field(
        True, "also write metrics.jsonl's rows as TensorBoard scalars (event files in the workdir; needs tensorboardX)"
    )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The section `mesh`: the device mesh, the logical-axis rules and the processes (core.mesh)."""

    compat: ClassVar[Compat] = False

    site: int = field(1, "mesh axis 'site' size (federated sites); -1 = all remaining devices", low=-1)
    data: int = field(-1, "mesh axis 'data' size (data parallel); -1 = all remaining devices", low=-1)
    expert: int = field(1, "mesh axis 'expert' size (expert parallel); -1 = all remaining devices", low=-1)
    model: int = field(1, "mesh axis 'model' size (tensor parallel); -1 = all remaining devices", low=-1)
    rules: tuple[tuple[str, Any], ...] = field(
        DEFAULT_RULES, "logical axis -> mesh axis rules: ((logical, mesh axis | tuple of mesh axes | None), ...)"
    )
    num_processes: int = field(
        1,
        "processes in a multi-process run (jax.distributed); -1 = those of the cluster environment (SLURM's srun, "
        "Open MPI's mpirun, Kubernetes, Cloud TPU), which then also gives process_id and coordinator_address "
        "(core.mesh.resolve_processes)",
        low=-1,
    )
    process_id: int = field(
        0, "this process's index in a multi-process run; leave it 0 with num_processes = -1 (the cluster's)", low=0
    )
    coordinator_address: str = field(
        "", "host:port of process 0 in a multi-process run; leave it '' with num_processes = -1 (the cluster's)"
    )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """The section `checkpoint`: when checkpoints are written and whether a run resumes (core.checkpoint)."""

    compat: ClassVar[Compat] = False
    provenance: ClassVar[Compat] = ("init_from",)

    init_from: str = field(
        "",
        "where step 0's weights come from: '' = random (train.seed); 'hf:DIR' = the Hugging Face checkpoint in DIR "
        "(its config.json sets the model and moe sections, experiments.hf)",
    )
    every: int = field(
        100,
        "steps between checkpoints (the last step is always saved); 0 = only the last; rounded up to whole calls: a "
        "federated run saves every ceil(every / fomoe.local_steps) rounds",
        low=0,
    )
    keep: int = field(2, "checkpoints kept on disk", low=1)
    resume: bool = field(True, "resume from the latest checkpoint in the workdir if there is one")
    fallback: bool = field(
        False,
        "when the latest checkpoint is damaged, move it to checkpoints.damaged/ and resume from the newest intact "
        "one (by default a damaged checkpoint stops the run)",
    )
    accept_changes: bool = field(
        False,
        "let a resume change training hyper-parameters (optim, data, train.steps / seed); each change is recorded "
        "in the workdir's history.jsonl (by default a resume refuses them)",
    )
    async_save: bool = field(False, "write checkpoints in a background thread")


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """The section `sample`: the text generated after training (core.generate)."""

    compat: ClassVar[Compat] = False

    prompt: str = field("def ", "prompt for the sample printed after training ('' = no sample)")
    num_tokens: int = field(200, "tokens to generate", low=0)
    temperature: float = field(0.7, "sampling temperature (0 = greedy)", low=0.0)
    top_k: int = field(0, "sample from the k most likely tokens (0 = all)", low=0)


SECTIONS: dict[str, type] = {
    "model": TransformerConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "mesh": MeshConfig,
    "checkpoint": CheckpointConfig,
    "sample": SampleConfig,
}
"""The core sections: name -> declaration. Other packages declare theirs the same way; the composition root
(`experiments/build.py`) adds them."""


def schema(sections: Mapping[str, type] | None = None) -> Schema:
    """The fields of `sections` (default: the core ones) as a fresh nested dict (callers may extend it)."""
    return {name: section_fields(cls) for name, cls in (SECTIONS if sections is None else sections).items()}


def checkpoint_compat(
    config: ml_collections.ConfigDict, sections: Mapping[str, type], data_fingerprint: str
) -> dict[str, Any]:
    """The facts a checkpoint must share with the running program to be resumed, from each section's `compat`
    declaration: whole sections as `{name: {key: value}}`, single keys as `{"name.key": value}`, and the corpus
    as `{"data": fingerprint}`."""
    facts: dict[str, Any] = {}
    for name, cls in sections.items():
        keys = getattr(cls, "compat", None)
        if keys is None:
            raise TypeError(f"config section {name!r} ({cls.__name__}) does not declare `compat`.")
        if keys is True:
            facts[name] = config[name].to_dict()
        elif keys:
            facts.update({f"{name}.{key}": config[name][key] for key in keys})
    return {**facts, "data": data_fingerprint}


def provenance(config: ml_collections.ConfigDict, sections: Mapping[str, type]) -> dict[str, Any]:
    """{"section.key": value} of every key a section declares in `provenance` (True: all keys its `compat` does
    not name): how the weights were trained, beyond what `checkpoint_compat` requires to be equal."""
    facts: dict[str, Any] = {}
    for name, cls in sections.items():
        keys = getattr(cls, "provenance", False)
        if keys is True:
            fixed = getattr(cls, "compat", False)
            keys = [k for k in config[name] if fixed is not True and k not in (fixed or ())]
        facts.update({f"{name}.{key}": config[name][key] for key in keys or ()})
    return facts


def defaults(spec: Schema | None = None) -> ml_collections.ConfigDict:
    """The default ConfigDict of a schema (the core schema by default). A key whose default is None holds a typed
    placeholder, so that the command line can still set it (`--config.optim.b2=0.99`)."""
    spec = schema() if spec is None else spec

    def default(f: Field) -> Any:
        if f.default is not None:
            return f.default
        return ml_collections.config_dict.placeholder(next(t for t in f.types if t is not type(None)))

    return ml_collections.ConfigDict(
        {section: {key: default(f) for key, f in fields.items()} for section, fields in spec.items()}
    )


def fit_to_steps(config: ml_collections.ConfigDict) -> list[str]:
    """Lowers, in place, the keys a short run would otherwise have to set by hand, and says what it changed.

    Today one key: `optim.warmup_steps` > `train.steps` becomes `train.steps` (the linear warm-up then spans the
    whole run, as the schedule of `core.train.learning_rate_schedule` with warmup = steps), so that a trial run
    (`--config.train.steps=10` on a config that warms up over 40 steps) needs no second flag. The cadences need no
    such fit: `train.log_every`, `train.eval_every` and `checkpoint.every` beyond `train.steps` still log, evaluate
    and save at the last step. A key of the wrong type is left for `validate` to report. The command-line driver
    (experiments.run) calls this once, before validation, so that the run's config.json holds the values used;
    `validate` itself still refuses a warm-up longer than the run (library callers set what they mean).

    Returns:
      one notice per changed key, e.g. "optim.warmup_steps = 40 > train.steps = 10: warming up over all 10 steps".
    """
    try:
        warmup, steps = config.optim.warmup_steps, config.train.steps
    except (AttributeError, KeyError):
        return []  # a missing section or key: validate names it
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (warmup, steps)) or steps < 1:
        return []
    if warmup <= steps:
        return []
    config.optim.warmup_steps = steps
    return [f"optim.warmup_steps = {warmup} > train.steps = {steps}: warming up over all {steps} steps"]


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

    With `mesh.num_processes = -1` (the cluster's processes) the checks that need the number of processes are
    deferred: validate again once `core.mesh.resolve_processes` has filled it in (see `check_processes`).

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
        federated = (
            f" (mesh.site = {sizes['site']} makes it a federated run: mesh.expert devices per site; "
            "--config.mesh.site=1 trains without federation)"
            if sizes["site"] > 1
            else ""
        )
        raise ConfigError(
            f"the mesh {sizes} needs {fixed} devices but only {num_devices} are available; "
            f"lower mesh.site/data/expert/model{federated}."
        )
    return sizes


MESH_AXES = ("site", "data", "expert", "model")
"""Mesh axis names, outermost first (slow links outermost: sites, then data, expert and model parallelism)."""


def mesh_shape(config: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """The mesh axis sizes {axis: size} with -1 resolved against `num_devices`."""
    return _mesh_shape(config.mesh, num_devices)


FROM_CLUSTER = -1
"""`mesh.num_processes = FROM_CLUSTER` (-1): the number of processes, this process's index and the coordinator's
address come from the cluster environment that started the process (`core.mesh.resolve_processes`)."""


def check_processes(mesh_cfg) -> None:
    """Checks the process keys of the mesh section (`num_processes`, `process_id`, `coordinator_address`) and raises
    ConfigError naming them.

    With `num_processes = -1` (FROM_CLUSTER) the cluster environment gives `process_id` and `coordinator_address`,
    so both must keep their defaults (0 and ''; an explicit `process_id=0` cannot be told from the default), and the
    checks that need the number of processes (`process_id` below it, `data.batch_size` divisible by it) wait until
    `core.mesh.resolve_processes` has filled in the cluster's values: validate again then (experiments.run does).
    """
    n = mesh_cfg.num_processes
    if n == 0:
        raise ConfigError(
            "config key 'mesh.num_processes' = 0; give the number of processes (>= 1), or -1 to take them from the "
            "cluster environment (srun, mpirun, ...)."
        )
    if n == FROM_CLUSTER:
        given = [
            f"'mesh.{key}' = {mesh_cfg[key]!r}"
            for key, default in (("process_id", 0), ("coordinator_address", ""))
            if mesh_cfg[key] != default
        ]
        if given:
            raise ConfigError(
                f"config key{'s' if len(given) > 1 else ''} {' and '.join(given)} set, but 'mesh.num_processes' = -1 "
                "takes this process's index and the coordinator's address from the cluster environment (e.g. "
                "SLURM_PROCID and the job's first node); remove "
                f"{'them' if len(given) > 1 else 'it'}, or give all three keys by hand with mesh.num_processes = N."
            )
        return
    if mesh_cfg.process_id >= n:
        raise ConfigError(f"config key 'mesh.process_id' = {mesh_cfg.process_id} must be < 'mesh.num_processes' = {n}.")
    if n > 1 and not mesh_cfg.coordinator_address:
        raise ConfigError(
            f"config key 'mesh.coordinator_address' is empty but 'mesh.num_processes' = {n}; give host:port of "
            "process 0 (e.g. 127.0.0.1:12355), or set mesh.num_processes = -1 under a cluster's launcher (srun, "
            "mpirun) to take all three from it."
        )


def mesh_axes(target) -> tuple[str, ...]:
    """A rule's target (or a PartitionSpec entry) as a tuple of mesh axes: None -> (), "data" -> ("data",)."""
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


def rule_mesh_axes(rules, logical: str) -> tuple[str, ...]:
    """The mesh axes `rules` map the logical axis `logical` to (() when it is replicated)."""
    return mesh_axes(dict(rules).get(logical))


def _check_core(config: ml_collections.ConfigDict, num_devices: int | None) -> None:
    m = config.model
    if m.head_dim == 0 and m.d_model % m.num_heads:
        raise ConfigError(
            f"config key 'model.num_heads' = {m.num_heads} must divide 'model.d_model' = "
            f"{m.d_model} (head dim = d_model / num_heads), or set 'model.head_dim'."
        )
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"config key 'model.num_kv_heads' = {m.num_kv_heads} must divide 'model.num_heads' = "
            f"{m.num_heads} (each KV head serves num_heads / num_kv_heads query heads)."
        )
    if m.head_dim % 2:
        raise ConfigError(f"config key 'model.head_dim' = {m.head_dim} must be even for RoPE.")
    if m.head_dim == 0 and (m.d_model // m.num_heads) % 2:
        raise ConfigError(
            f"head dim d_model / num_heads = {m.d_model // m.num_heads} (model.d_model = "
            f"{m.d_model}, model.num_heads = {m.num_heads}) must be even for RoPE; or set 'model.head_dim'."
        )
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise ConfigError(
            f"config key 'model.rope_high_freq_factor' = {m.rope_high_freq_factor} must exceed "
            f"'model.rope_low_freq_factor' = {m.rope_low_freq_factor} (rope_scaling 'llama3')."
        )
    try:
        tok = tokenizer_lib.load(config.data.tokenizer)
    except tokenizer_lib.TokenizerError as e:
        raise ConfigError(str(e)) from None
    if m.vocab_size < tok.vocab_size:
        what = "bytes + PAD, BOS, EOS" if config.data.tokenizer == "bytes" else config.data.tokenizer
        raise ConfigError(
            f"config key 'model.vocab_size' = {m.vocab_size} is smaller than the vocab_size of 'data.tokenizer' = "
            f"{config.data.tokenizer!r}: {tok.vocab_size} ids ({what})."
        )
    o = config.optim
    if o.warmup_steps > config.train.steps:
        raise ConfigError(
            f"config key 'optim.warmup_steps' = {o.warmup_steps} exceeds 'train.steps' = {config.train.steps}; "
            "lower it to at most train.steps (python -m experiments.run does so itself: core.config.fit_to_steps)."
        )
    mesh = config.mesh
    check_processes(mesh)
    if mesh.num_processes != FROM_CLUSTER and config.data.batch_size % mesh.num_processes:
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
        bad = [f"'model.{key}' = {m[key]}" for key in ("num_heads", "num_kv_heads", "d_ff") if m[key] % sizes["model"]]
        if bad:  # every key at once, so that one rerun fixes them all
            raise ConfigError(
                f"config key{'s' if len(bad) > 1 else ''} {' and '.join(bad)} must be divisible by the mesh axis "
                f"'model' = {sizes['model']} (mesh.model), which shards {'them' if len(bad) > 1 else 'it'}."
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
