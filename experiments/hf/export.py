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

import contextlib
import dataclasses
import errno
import filecmp
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import ml_collections
import ml_dtypes
import numpy as np
from flax import nnx

from core import fields as fields_lib
from core import workdir as workdir_lib
from core.byte_tokenizer import CONFIG_FILE, TOKENIZER_FILE
from experiments import schema
from experiments.hf import arch as arch_lib
from experiments.hf import generation, weights
from experiments.hf import load as hf_load
from moe.config import MoEConfig

__all__ = ["DTYPES", "ExportWriteError", "HFExportError", "check_out", "hf_config", "model_files", "recover", "save"]

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

    moe = fields_lib.from_config(MoEConfig, config.moe)
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
    moe = dataclasses.asdict(fields_lib.from_config(MoEConfig, config.moe))
    out = {f"model.{k}": v for k, v in model.items()} | {f"moe.{k}": v for k, v in moe.items()}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


def model_files(out_dir: str) -> list[str]:
    """The names of the files in `out_dir` that make up a Hugging Face model (weights, their index, configs,
    tokenizer, chat template): what an export writes, and what `save(..., replace=True)` removes first."""
    if not os.path.isdir(out_dir):
        return []
    fixed = {"model.safetensors.index.json", "config.json", "generation_config.json", "chat_template.jinja"}
    fixed |= {TOKENIZER_FILE, CONFIG_FILE, "special_tokens_map.json"}
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
    Files are written readable by others, as transformers writes them (0666 less the umask).

    Crash safety: every file is first written into `<out_dir>.exporting`. Into a new or empty `out_dir` that folder
    then becomes `out_dir` in one rename, so a kill at any instant leaves either `out_dir` as it was or the whole
    export, and the next export removes what a killed one left. With `replace` (a folder holding other files) the
    complete folder is first renamed `<out_dir>.exported` with the list of its files, then its files replace the
    folder's model files; an export killed in between is finished by the next export into the same `out_dir`
    before it starts (`recover`). An export into a folder that already holds exactly this export (a rerun after a
    kill at the last instant) writes nothing there and returns its files.

    Returns the files of the export in `out_dir`. `out_dir` must be new or empty, or hold only the model files of
    this same export; with `replace`, the model files already there (`model_files`: stale shards and their index
    included) are removed and other files are kept. Raises HFExportError, before anything is written into or
    removed from `out_dir`, if it is not empty (without `replace`), cannot be written (`check_out`), the imported
    checkpoint's config.json cannot be read or the model maps to no supported architecture;
    core.tokenizer.TokenizerError if the run's tokenizer cannot be loaded; ExportWriteError if writing fails (a full
    disk: checked first from the tensors' size, or met while writing), with `out_dir` left as it was and the partial
    files removed."""
    from safetensors.numpy import save_file  # an optional dependency ([experiments]): imported where it is used

    if dtype is not None and dtype not in DTYPES:
        raise HFExportError(f"dtype = {dtype!r}; allowed: {list(DTYPES)}")
    recover(out_dir)
    check_out(out_dir, replace=replace)
    tok = generation.run_tokenizer(config)  # saved with the framing our server applies (BOS for a run trained here)
    hf = {**hf_config(config), "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    source, imported = _source(config)
    dtype = dtype or next((imported[k] for k in ("dtype", "torch_dtype") if imported.get(k) in DTYPES), "float32")
    hf |= {"dtype": dtype, "max_position_embeddings": imported.get("max_position_embeddings", config.data.seq_len)}
    params = {
        ".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    moe = fields_lib.from_config(MoEConfig, config.moe)
    experts = arch_lib.get(hf["architectures"][0]).experts  # type: ignore[union-attr]  # hf_config's own entry
    tensors = weights.from_ours(params, schema.model_config(config), moe, experts=experts)
    tensors = {name: x.astype(DTYPES[dtype]) for name, x in tensors.items()}
    stage = _staging(out_dir)
    _check_space(out_dir, sum(x.nbytes for x in tensors.values()))
    try:
        written = _write(stage, tensors, hf, tok, source, max_shard_bytes, save_file)
    except Exception as e:  # a full disk (safetensors' SafetensorError, an OSError), a folder made read-only
        shutil.rmtree(stage, ignore_errors=True)
        raise ExportWriteError(
            f"the export could not be written to {stage}: {_cause(e)}; nothing was written to --out {out_dir} "
            "(the partial files were removed)"
        ) from None
    names = [os.path.basename(path) for path in written]
    if not replace and model_files(out_dir):  # (check_out: nothing else is there) a rerun of a finished export?
        if _same_files(stage, out_dir, names):
            shutil.rmtree(stage, ignore_errors=True)
            return [os.path.join(out_dir, n) for n in names]
        shutil.rmtree(stage, ignore_errors=True)
        raise _not_empty(out_dir)
    if not (os.path.isdir(out_dir) and os.listdir(out_dir)):  # new or empty: one rename is the whole export
        with contextlib.suppress(OSError):  # (an empty folder that cannot be replaced, a mount point: as below)
            os.replace(stage, out_dir)
            return [os.path.join(out_dir, n) for n in names]
    workdir_lib.write_json(os.path.join(stage, _FILES), names)
    os.replace(stage, _finished(out_dir))  # complete: from here the next export finishes it if this one is killed
    recover(out_dir)
    return [os.path.join(out_dir, n) for n in names]


class ExportWriteError(RuntimeError):
    """An export could not be written (a full disk, ...): the message names the folder and the cause; nothing was
    written to --out and the partial files were removed."""


def check_out(out_dir: str, *, replace: bool) -> None:
    """Raises HFExportError if `out_dir` cannot take an export, before anything is loaded or written: it is not a
    folder, it holds files other than a model's (without `replace`), a model file there is not a regular file (with
    `replace`), or its folder cannot be written (tried by creating and removing an empty folder beside it, which
    also finds a read-only file system whatever the user's rights)."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise HFExportError(f"--out {out_dir} is a file, not a folder; allowed: a new or empty folder")
    held = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    model = model_files(out_dir)
    if held and not replace and set(held) != set(model):
        raise _not_empty(out_dir)
    odd = [n for n in model if not os.path.isfile(os.path.join(out_dir, n))]
    if odd:
        what = "a folder" if os.path.isdir(os.path.join(out_dir, odd[0])) else "no regular file"
        raise HFExportError(
            f"--out {out_dir} holds {odd[0]} as {what}, where an export writes a file: move it away; allowed: a new "
            "or empty folder"
        )
    parent = os.path.dirname(_staging(out_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".export-check-", dir=parent))
        if os.path.isdir(out_dir) and replace and held:
            os.rmdir(tempfile.mkdtemp(prefix=".export-check-", dir=out_dir))
    except OSError as e:
        raise HFExportError(
            f"--out {out_dir} cannot be written ({e.strerror or e}); allowed: a folder this user can write"
        ) from None


def recover(out_dir: str) -> None:
    """Clears what an export into `out_dir` killed earlier left: `<out_dir>.exporting` (files not yet complete) is
    removed; `<out_dir>.exported` (complete, killed while its files replaced the folder's model files) is finished:
    the model files not in it are removed from `out_dir` and its files moved in. Raises HFExportError naming the
    folder if that cannot be done."""
    shutil.rmtree(_staging(out_dir), ignore_errors=True)
    done = _finished(out_dir)
    if not os.path.isdir(done):
        return
    try:
        names = _names(done)
        for name in model_files(out_dir):
            if name not in names:
                os.remove(os.path.join(out_dir, name))
        for name in names:
            if os.path.exists(os.path.join(done, name)):
                os.replace(os.path.join(done, name), os.path.join(out_dir, name))
        shutil.rmtree(done)
    except (OSError, ValueError) as e:
        raise HFExportError(
            f"{done} holds an earlier export into --out {out_dir} that was stopped while its files moved in, and it "
            f"cannot be finished ({_cause(e)}); move its files into {out_dir} or remove it"
        ) from None


_FILES = ".files.json"  # in `<out>.exported`: the names of the export's files


def _names(done: str) -> list[str]:
    with open(os.path.join(done, _FILES)) as f:
        return list(json.load(f))


def _write(stage, tensors, hf, tok, source, max_shard_bytes, save_file) -> list[str]:
    """Writes the whole export into the new folder `stage`; returns its files."""
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
    written += [os.path.join(stage, name) for name in (TOKENIZER_FILE, CONFIG_FILE)]
    written += _carry(source, stage) if source else []
    mode = 0o666 & ~_umask()
    for path in written:
        os.chmod(path, mode)
    os.chmod(stage, 0o777 & ~_umask())
    return written


def _source(config: ml_collections.ConfigDict) -> tuple[str | None, dict[str, Any]]:
    """(DIR, its config.json) of the checkpoint the run was imported from (hf_load.source_config). Raises
    HFExportError if DIR is there but its config.json cannot be read as a JSON object: the export would silently
    lose the dtype and max_position_embeddings it carries."""
    source, imported = hf_load.source_config(config)
    if source is not None and not imported:
        path = os.path.join(source, "config.json")
        what = "a directory" if os.path.isdir(path) else "missing" if not os.path.exists(path) else "no JSON object"
        raise HFExportError(
            f"{path}, the config of the checkpoint this run was imported from (checkpoint.init_from), is {what}: an "
            "export carries its dtype and max_position_embeddings. Restore it, or move that folder away to export "
            "with the run's own (float32 unless --dtype; max_position_embeddings = data.seq_len)"
        )
    return source, imported


def _check_space(out_dir: str, tensor_bytes: int) -> None:
    """Raises ExportWriteError, before anything is written, if the disk of `out_dir` has less free space than the
    tensors and 16 MiB for the tokenizer and configs."""
    need = tensor_bytes + 16 * 2**20
    free = shutil.disk_usage(os.path.dirname(_staging(out_dir))).free
    if need > free:
        raise ExportWriteError(
            f"the export to --out {out_dir} needs about {need / 2**20:,.1f} MiB and its disk has {free / 2**20:,.1f} "
            "MiB free (No space left on device): nothing was written"
        )


def _cause(e: BaseException) -> str:
    """What stopped a write, in one line ("No space left on device" for a full disk, whatever raised it)."""
    text = " ".join(str(e).split())
    if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in text or "StorageFull" in text:
        return "No space left on device"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {text[:200]}"


def _same_files(stage: str, out_dir: str, names: list[str]) -> bool:
    """Whether `out_dir`'s model files are exactly `names`, each with the bytes of the one in `stage`."""
    if sorted(model_files(out_dir)) != sorted(names):
        return False
    return all(filecmp.cmp(os.path.join(stage, n), os.path.join(out_dir, n), shallow=False) for n in names)


def _not_empty(out_dir: str) -> HFExportError:
    held = model_files(out_dir) or sorted(os.listdir(out_dir))
    return HFExportError(
        f"--out {out_dir} is not empty (it holds {', '.join(held[:5])}{', ...' if len(held) > 5 else ''}): "
        "allowed: a new or empty folder, or --replace to remove the model files there first"
    )


def _staging(out_dir: str) -> str:
    """The folder beside `out_dir` an export writes into before it becomes (or its files move into) `out_dir`
    (`<out>.exporting`): a killed export leaves its partial files there, never in `out_dir`, and the next export
    removes them."""
    return os.path.abspath(out_dir).rstrip(os.sep) + ".exporting"


def _finished(out_dir: str) -> str:
    """`<out>.exported`: a complete export whose files are replacing the model files of `out_dir` (with --replace)."""
    return os.path.abspath(out_dir).rstrip(os.sep) + ".exported"


def _carry(source: str, out_dir: str) -> list[str]:
    """Copies `source`'s generation_config.json and chat template into `out_dir` (the template as
    chat_template.jinja, or into the exported tokenizer_config.json where the source kept it there). Returns the
    files written."""
    written = []
    for name in ("generation_config.json", "chat_template.jinja"):
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
            written.append(os.path.join(out_dir, name))
    template = hf_load.json_object(os.path.join(source, CONFIG_FILE)).get("chat_template")
    if template is not None:
        path = os.path.join(out_dir, CONFIG_FILE)
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
