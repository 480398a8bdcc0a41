"""The core sections of the experiment configuration: `model` (the transformer's hyper-parameters, which
core.model.Transformer takes), `data`, `optim`, `train`, `mesh`, `checkpoint` and `sample`, each a frozen
dataclass of `core.fields.field`s, and `SECTIONS` (name -> declaration). Plain typed values (no configuration
library): core.schema builds the ConfigDict, the per-key checks and `validate` (the constraints between keys) on
these declarations, and the composition root (experiments/schema.py) adds the other packages' sections.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from core.fields import MAX_WIDTH, Compat, field
from core.mesh_config import DEFAULT_RULES

__all__ = [
    "SECTIONS",
    "CheckpointConfig",
    "DataConfig",
    "MeshConfig",
    "OptimConfig",
    "SampleConfig",
    "TrainConfig",
    "TransformerConfig",
]


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
    families add their own keys by subclassing (experiments.schema_optim); the composition root registers the names."""

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
