"""The experiment configuration: an `ml_collections.ConfigDict` with one sub-dict per section, each section a frozen
dataclass of `core.fields.field`s (the core ones in core.config; the composition root, experiments/schema.py, adds
the others), and what is derived from the declarations.

From the declarations come the default ConfigDict (`defaults`), the reference table (`describe`), the resume facts
(`checkpoint_compat`, `provenance`) and the per-key checks (`check_keys`):

  * an unknown key (a typo such as `model.dmodel`) -> error naming the key and the closest known keys;
  * a wrong type (`train.steps = "300"`)           -> error naming the key, the value and the accepted types;
  * a value outside its choices or range           -> error naming the key, the value and what is allowed.

`validate` checks every key, type and value and then the core sections' constraints between keys: an impossible
combination (heads not dividing d_model, a mesh larger than the devices, a batch the data axis cannot split, ...)
-> ConfigError naming every key involved. The command line fits a warm-up longer than a short run to the run's
length before validating (`fit_to_steps`). This module is the one place in core/ that imports ml_collections; the
typed sections themselves (core.config, core.fields) do not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import ml_collections

from core import config as config_lib
from core import tokenizer as tokenizer_lib
from core.byte_tokenizer import TokenizerError
from core.fields import ConfigError, Field, section_fields, unknown_key_error
from core.mesh_config import FROM_CLUSTER, check_processes, check_rules, resolve_mesh_shape, rule_mesh_axes

__all__ = [
    "Schema",
    "check_keys",
    "checkpoint_compat",
    "defaults",
    "describe",
    "fields_of",
    "fit_to_steps",
    "provenance",
    "schema",
    "validate",
    "without_new_defaults",
]


Schema = dict[str, dict[str, Field]]
"""section name -> key -> Field (what `validate`, `defaults` and `describe` read)."""


def fields_of(sections: Mapping[str, type]) -> Schema:
    """The Schema of `sections` (name -> section dataclass) as a fresh nested dict (callers may extend it)."""
    return {name: section_fields(cls) for name, cls in sections.items()}


def without_new_defaults(values: Mapping[str, Any], rules: Mapping[str, Field]) -> dict[str, Any]:
    """A section's `values` less its `since_checkpoints` keys (`rules`: the section's Fields) at their default: what
    a record written before those keys existed holds, so the two compare equal."""
    return {
        k: v for k, v in values.items() if not (k in rules and rules[k].since_checkpoints and v == rules[k].default)
    }


def checkpoint_compat(
    config: ml_collections.ConfigDict, sections: Mapping[str, type], data_fingerprint: str
) -> dict[str, Any]:
    """The facts a checkpoint must share with the running program to be resumed, from each section's `compat`
    declaration: whole sections as `{name: {key: value}}` (less the `since_checkpoints` keys at their default),
    single keys as `{"name.key": value}`, and the corpus as `{"data": fingerprint}`."""
    facts: dict[str, Any] = {}
    for name, cls in sections.items():
        keys = getattr(cls, "compat", None)
        if keys is None:
            raise TypeError(f"config section {name!r} ({cls.__name__}) does not declare `compat`.")
        if keys is True:
            facts[name] = without_new_defaults(config[name].to_dict(), section_fields(cls))
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
    """The default ConfigDict of a schema (the core sections' by default). A key whose default is None holds a
    typed placeholder, so that the command line can still set it (`--config.optim.b2=0.99`)."""
    spec = schema() if spec is None else spec

    def default(f: Field) -> Any:
        if f.default is not None:
            return f.default
        return ml_collections.config_dict.placeholder(next(t for t in f.types if t is not type(None)))

    return ml_collections.ConfigDict(
        {section: {key: default(f) for key, f in fields.items()} for section, fields in spec.items()}
    )


def check_keys(config: ml_collections.ConfigDict, spec: Schema) -> None:
    """Checks that `config` holds exactly the keys of `spec`, each of an accepted type and value; raises
    ConfigError on the first problem: an unknown section or key (naming the closest known ones), a value of the
    wrong type or outside its choices or range (naming the key, the value and what is allowed), or a missing key.
    Constraints between keys are `validate`'s."""
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
                    f"(core.schema.defaults or experiments.schema.default_config)."
                )


def describe(spec: Schema | None = None) -> str:
    """A markdown reference of every key of `spec` (the core sections' by default; docs/configuration.md): one table
    per section with each key's default, what is allowed and its meaning."""
    spec = schema() if spec is None else spec
    lines = []
    for section, fields in spec.items():
        lines += [f"## `{section}`", "", "| key | default | allowed | meaning |", "|---|---|---|---|"]
        for key, f in fields.items():
            allowed = f.describe().replace("|", "\\|")
            lines.append(f"| `{section}.{key}` | `{f.default!r}` | {allowed} | {f.doc.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


def schema(sections: Mapping[str, type] | None = None) -> Schema:
    """The fields of `sections` (default: the core ones) as a fresh nested dict (callers may extend it)."""
    return fields_of(config_lib.SECTIONS if sections is None else sections)


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
            "lower it to at most train.steps (python -m experiments.run does so itself: core.schema.fit_to_steps)."
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
