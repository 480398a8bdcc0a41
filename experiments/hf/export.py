"""Our model -> a Hugging Face checkpoint directory (config.json + safetensors), where it fits an architecture.

    export.save(config, model, "out/")   # config.json, model.safetensors (or shards + index past `max_shard_bytes`)

The architecture is the entry of experiments.hf.arch the config fits (`arch.choose`, in the table's order: a MoE
model is Qwen3-MoE with q/k norm, else Mixtral; a dense model is Qwen3 with q/k norm, Qwen2 with q/k/v biases but
no output bias, else Llama), and config.json is written from that entry's keys, the ones the importer reads. What no
architecture can express (a sigmoid router, LayerNorm, Peri-LN, SiLU-only MLPs or experts, a shared expert, ...)
raises `HFExportError` naming the config key and its value, before anything is written. Tensors are mapped by
`weights.layout`, the table the importer reads, so import(export(model)) is the model.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping
from typing import Any

import ml_collections
import ml_dtypes
import numpy as np
from flax import nnx

from core import config as config_lib
from core import tokenizer as tokenizer_lib
from core import workdir as workdir_lib
from experiments import schema
from experiments.hf import arch as arch_lib
from experiments.hf import load as hf_load
from experiments.hf import weights
from moe.config import MoEConfig

__all__ = ["DTYPES", "HFExportError", "hf_config", "model_files", "save"]

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
"""The tensor dtypes an export writes (`save(..., dtype=)`, `export --dtype`)."""


class HFExportError(ValueError):
    """The model has a feature no supported Hugging Face architecture expresses; the message names the key."""


def hf_config(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config.json of `config`'s model (transformers 5's layout; `rope_parameters` holds theta and scaling),
    written from the entry of experiments.hf.arch the config fits (`arch.choose`). Raises HFExportError naming the
    first config key no supported architecture allows, before anything is written."""
    values = _values(config)

    def refuse(key: str, value: Any, why: str) -> HFExportError:
        return HFExportError(f"config key '{key}' = {value!r}: {why}; no supported Hugging Face architecture has it")

    def require(fixed) -> None:
        for f in fixed:
            if values[f.ours] != f.value:
                raise refuse(f.ours, values[f.ours], f.why)

    moe = config_lib.from_config(MoEConfig, config.moe)
    dense_layers = any(not moe.is_moe_layer(i) for i in range(config.model.num_layers))
    require((*arch_lib.COMMON_FIXED, *((arch_lib.DENSE_FIXED,) if dense_layers else ())))
    if config.mesh.site > 1 and moe.every and config.fomoe.routing == "skip_token":
        raise refuse("fomoe.routing", config.fomoe.routing, "a skip-token site routes over experts it does not hold")
    if moe.every:
        require(arch_lib.MOE_FIXED)
    entry = arch_lib.choose(values)
    require(entry.fixed)
    out: dict[str, Any] = {"architectures": [entry.name], "model_type": entry.model_type}
    for key in entry.all_keys():
        if not key.written:
            continue
        for other in key.also:
            if values[other] != values[key.ours]:
                raise refuse(
                    other,
                    values[other],
                    f"{entry.name} holds it and {key.ours} (= {values[key.ours]!r}) in one field, '{key.hf}'",
                )
        out[key.hf] = key.write(values[key.ours])
    out.update(arch_lib.WRITTEN, rope_parameters=arch_lib.rope_to_hf(config.model), dtype=config.model.param_dtype)
    return out


def _values(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """{"section.key": value} of the `model` (head_dim resolved: 0 means d_model / num_heads) and `moe` sections,
    tuples as tuples (a config read back from JSON holds lists)."""
    model = dataclasses.asdict(schema.model_config(config))
    moe = dataclasses.asdict(config_lib.from_config(MoEConfig, config.moe))
    out = {f"model.{k}": v for k, v in model.items()} | {f"moe.{k}": v for k, v in moe.items()}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


def model_files(out_dir: str) -> list[str]:
    """The names of the files in `out_dir` that make up a Hugging Face model (weights, their index, configs,
    tokenizer, chat template): what an export writes, and what `save(..., replace=True)` removes first."""
    if not os.path.isdir(out_dir):
        return []
    fixed = {"model.safetensors.index.json", "config.json", "generation_config.json", "chat_template.jinja"}
    fixed |= {tokenizer_lib.TOKENIZER_FILE, tokenizer_lib.CONFIG_FILE, "special_tokens_map.json"}
    return sorted(n for n in os.listdir(out_dir) if n in fixed or n.endswith(".safetensors"))


def save(
    config: ml_collections.ConfigDict,
    model: nnx.Module,
    out_dir: str,
    *,
    max_shard_bytes: int = 5 * 2**30,
    replace: bool = False,
    dtype: str | None = None,
) -> list[str]:
    """Writes `model` (a core.model.Transformer built from `config`) to `out_dir` as a Hugging Face checkpoint:
    config.json and model.safetensors, or shards model-0000i-of-0000n.safetensors with model.safetensors.index.json
    when the tensors exceed `max_shard_bytes`, and the run's tokenizer (`data.tokenizer`, the byte tokenizer
    included) as tokenizer.json + tokenizer_config.json (core.tokenizer: transformers' AutoTokenizer loads them).
    config.json carries the tokenizer's BOS / EOS / PAD ids, so that transformers' generate stops at our EOS.
    What the run was imported from (`checkpoint.init_from = "hf:DIR"`, where DIR still exists) is carried over:
    its generation_config.json, its chat template (chat_template.jinja, or tokenizer_config.json's
    `chat_template`), its max_position_embeddings (else the run's data.seq_len), and its tensors' dtype: `dtype`
    (a key of DTYPES) if given, else the imported checkpoint's config.json `dtype` / `torch_dtype`, else float32.
    Files are written readable by others, as transformers writes them (0666 less the umask), first into
    `<out_dir>.exporting` (a killed export leaves nothing in `out_dir`; the next export removes that folder) and
    moved into `out_dir` once all are written.
    Returns the files written. `out_dir` must be new or empty; with `replace`, the model files already there
    (`model_files`: stale shards and their index included) are removed first and other files are kept. Raises
    HFExportError first if `out_dir` is not empty (without `replace`) or the model maps to no supported
    architecture, and core.tokenizer.TokenizerError if the run's tokenizer cannot be loaded (all before anything is
    written or removed)."""
    from safetensors.numpy import save_file  # an optional dependency ([experiments]): imported where it is used

    if dtype is not None and dtype not in DTYPES:
        raise HFExportError(f"dtype = {dtype!r}; allowed: {list(DTYPES)}")
    if not replace and os.path.isdir(out_dir) and os.listdir(out_dir):
        held = model_files(out_dir) or sorted(os.listdir(out_dir))
        raise HFExportError(
            f"--out {out_dir} is not empty (it holds {', '.join(held[:5])}{', ...' if len(held) > 5 else ''}): "
            "allowed: a new or empty folder, or --replace to remove the model files there first"
        )
    tok = tokenizer_lib.load(config.data.tokenizer)
    hf = {**hf_config(config), "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    source, imported = hf_load.source_config(config)
    dtype = dtype or next((imported[k] for k in ("dtype", "torch_dtype") if imported.get(k) in DTYPES), "float32")
    hf |= {"dtype": dtype, "max_position_embeddings": imported.get("max_position_embeddings", config.data.seq_len)}
    params = {
        ".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    moe = config_lib.from_config(MoEConfig, config.moe)
    experts = arch_lib.get(hf["architectures"][0]).experts  # type: ignore[union-attr]  # hf_config's own entry
    tensors = weights.from_ours(params, schema.model_config(config), moe, experts=experts)
    tensors = {name: x.astype(DTYPES[dtype]) for name, x in tensors.items()}
    stage = _staging(out_dir)
    shutil.rmtree(stage, ignore_errors=True)  # what a killed export left
    os.makedirs(stage)
    shards = _shards(tensors, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(stage, name), metadata={"format": "pt"})
    written = [os.path.join(stage, n) for n in names]
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
            "weight_map": {t: n for n, shard in zip(names, shards) for t in shard},
        }
        written.append(os.path.join(stage, "model.safetensors.index.json"))
        workdir_lib.write_json(written[-1], index)
    written.append(os.path.join(stage, "config.json"))
    workdir_lib.write_json(written[-1], hf)
    tok.save(stage)
    written += [os.path.join(stage, name) for name in (tokenizer_lib.TOKENIZER_FILE, tokenizer_lib.CONFIG_FILE)]
    written += _carry(source, stage) if source else []
    mode = 0o666 & ~_umask()
    for path in written:
        os.chmod(path, mode)
    for name in model_files(out_dir) if replace else ():  # (only now: a failed export leaves the folder as it was)
        os.remove(os.path.join(out_dir, name))
    os.makedirs(out_dir, exist_ok=True)
    moved = []
    for path in written:
        moved.append(os.path.join(out_dir, os.path.basename(path)))
        os.replace(path, moved[-1])
    shutil.rmtree(stage, ignore_errors=True)
    return moved


def _staging(out_dir: str) -> str:
    """The folder beside `out_dir` an export writes into before moving its files in (`<out>.exporting`): a killed
    export leaves its partial files there, never in `out_dir`, and the next export removes them."""
    return os.path.abspath(out_dir).rstrip(os.sep) + ".exporting"


def _carry(source: str, out_dir: str) -> list[str]:
    """Copies `source`'s generation_config.json and chat template into `out_dir` (the template as
    chat_template.jinja, or into the exported tokenizer_config.json where the source kept it there). Returns the
    files written."""
    written = []
    for name in ("generation_config.json", "chat_template.jinja"):
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
            written.append(os.path.join(out_dir, name))
    template = hf_load.json_object(os.path.join(source, tokenizer_lib.CONFIG_FILE)).get("chat_template")
    if template is not None:
        path = os.path.join(out_dir, tokenizer_lib.CONFIG_FILE)
        workdir_lib.write_json(path, {**hf_load.json_object(path), "chat_template": template})
    return written


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _shards(tensors: Mapping[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    """The tensors in order, cut into groups of at most `max_bytes` (a larger tensor gets a group of its own)."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, x in tensors.items():
        if shards[-1] and size + x.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
    return shards
