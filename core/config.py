"""The core configuration sections and their checks before anything compiles.

A configuration is an `ml_collections.ConfigDict` with one sub-dict per section: the core ones declared here
(`model`, `data`, `optim`, `train`, `mesh`, `checkpoint`, `sample`) and those other packages declare the same way
(moe.config, quant.config, kvcache.config, optim.config), each a frozen dataclass of `core.schema.field`s. The
composition root (`experiments/schema.py`) adds the others to `SECTIONS` and fills registered choices (`optim.name`).

`validate` checks every key, type and value (`core.schema.check_keys`) and then the core sections' constraints
between keys: an impossible combination (heads not dividing d_model, a mesh larger than the devices, a batch the
data axis cannot split, ...) -> ConfigError naming every key involved. The command line fits a warm-up longer than
a short run to the run's length before validating (`fit_to_steps`). The schema machinery (`field`, `ConfigError`,
`from_config`, `checkpoint_compat`, ...) is `core.schema`'s; its names are importable from here too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import ml_collections

from core import schema as schema_lib
from core import tokenizer as tokenizer_lib
from core.byte_tokenizer import TokenizerError
from core.mesh_config import (
    DEFAULT_RULES,
    FROM_CLUSTER,
    MESH_AXES,
    check_processes,
    check_rules,
    mesh_axes,
    mesh_shape,
    resolve_mesh_shape,
    rule_mesh_axes,
)
from core.schema import (
    Compat,
    ConfigError,
    Field,
    Schema,
    check_keys,
    checkpoint_compat,
    field,
    fields_of,
    from_config,
    provenance,
    section_fields,
    unknown_key_error,
)

__all__ = [
    "DEFAULT_RULES",
    "FROM_CLUSTER",
    "MAX_WIDTH",
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


_DTYPES = ("float32", "bfloat16")

MAX_WIDTH = 2**20
"""The largest value of a model's size keys (vocabulary, widths, heads, layers, experts): 1,048,576, above any published
model's (their widths and vocabularies are at most a few 100,000). It keeps every weight's element count far inside
the 64 bits XLA counts it in (past them XLA aborts the process instead of raising), and a config.json edited to a
huge width is refused by name instead of failing later as something else."""


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The section `model`: the transformer's hyper-parameters (core.model.Transformer)."""

    compat: ClassVar[Compat] = True

    vocab_size: int = field(
        264,
        "embedding rows; >= the tokenizer's vocab_size (data.tokenizer; bytes: 259 = 256 bytes + PAD/BOS/EOS), a "
        "multiple of 8 keeps matmuls aligned",
        low=1,
        high=MAX_WIDTH,
    )
    d_model: int = field(256, "residual stream width", low=1, high=MAX_WIDTH)
    num_layers: int = field(4, "transformer blocks", low=1, high=MAX_WIDTH)
    num_heads: int = field(8, "query heads; must divide d_model unless head_dim is set", low=1, high=MAX_WIDTH)
    num_kv_heads: int = field(
        8, "key/value heads (grouped-query attention); must divide num_heads", low=1, high=MAX_WIDTH
    )
    head_dim: int = field(
        0, "width of each query/key/value head (even); 0 = d_model / num_heads", low=0, high=MAX_WIDTH
    )
    qkv_bias: bool = field(False, "biases on the query, key and value projections (Qwen2)")
    out_bias: bool = field(False, "a bias on the attention output projection")
    qk_norm: bool = field(False, "RMSNorm over each query and key head before RoPE, a learned scale per dim (Qwen3)")
    qk_norm_over: str = field(
        "head",
        "with qk_norm: 'head' (each head of head_dim, one scale shared by the heads: Qwen3) or 'projection' (the "
        "whole query and key projections, a scale per channel: OLMoE)",
        choices=("head", "projection"),
        since_checkpoints=True,
    )
    d_ff: int = field(1024, "hidden width of the dense MLP", low=1, high=MAX_WIDTH)
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
    attention_impl: str = field(
        "xla",
        "training attention: 'xla' (core.attention's, causal blocks skipped) or 'cudnn' (jax.nn's cuDNN kernel)",
        choices=("xla", "cudnn"),
    )

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
    learning_rate: float = field(3e-3, "peak learning rate (0 would train nothing)", low=0.0, low_open=True)
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
(`experiments/schema.py`) adds them."""


def schema(sections: Mapping[str, type] | None = None) -> Schema:
    """The fields of `sections` (default: the core ones) as a fresh nested dict (callers may extend it)."""
    return fields_of(SECTIONS if sections is None else sections)


def defaults(spec: Schema | None = None) -> ml_collections.ConfigDict:
    """The default ConfigDict of a schema (the core schema by default; `core.schema.defaults`)."""
    return schema_lib.defaults(schema() if spec is None else spec)


def describe(spec: Schema | None = None) -> str:
    """A markdown reference of every key of a schema (the core schema by default; `core.schema.describe`)."""
    return schema_lib.describe(schema() if spec is None else spec)


def fit_to_steps(config: ml_collections.ConfigDict) -> list[str]:
    """Lowers, in place, the keys a short run would otherwise have to set by hand, and says what it changed.

    One key: `optim.warmup_steps` > `train.steps` becomes `train.steps` (the linear warm-up then spans the
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


def validate(
    config: ml_collections.ConfigDict,
    spec: Schema | None = None,
    *,
    num_devices: int | None = None,
) -> None:
    """Checks every key, type, value (`core.schema.check_keys`) and the core sections' cross-field constraints;
    raises ConfigError on the first problem.

    With `mesh.num_processes = -1` (the cluster's processes) the checks that need the number of processes are
    deferred: validate again once `core.mesh.resolve_processes` has filled it in (see `check_processes`).

    Args:
      config: the experiment configuration.
      spec: the schema to check against (default: the core schema).
      num_devices: if given, the mesh is also checked against this number of devices.
    """
    check_keys(config, schema() if spec is None else spec)
    _check_core(config, num_devices)


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
    except TokenizerError as e:
        raise ConfigError(str(e)) from None
    if m.vocab_size < tok.vocab_size and not config.checkpoint.init_from:  # (else: the checkpoint's, apply_to's)
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
    check_rules(mesh.rules)
    sizes = resolve_mesh_shape(mesh, num_devices)
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
