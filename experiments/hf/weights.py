"""A Hugging Face checkpoint's safetensors -> our parameters, by name, with every shape and dtype checked.

    tensors = weights.read(hf_dir)                    # {hf name: np.ndarray}, one file or an index of shards
    weights.check(weights.headers(hf_dir), model_cfg, moe_cfg, source=hf_dir)  # the same checks, headers only
    params = weights.to_ours(tensors, model_cfg, moe_cfg, source=hf_dir)  # {our path ("blocks.0.attn.q.kernel"): array}
    tensors = weights.from_ours(params, model_cfg, moe_cfg, experts=arch.experts)  # and back (experiments.hf.export)

Both directions read one table, `layout` (from experiments.hf.arch): every checkpoint tensor's name and shape, our
path, and how they relate.

Layout differences the mapping undoes: PyTorch's Linear stores [out, in] (ours [in, out]); experts are one tensor
per expert and projection (ours one [E, in, out] stack per projection); the router is `gate` / `block_sparse_moe.gate`
[E, d] (ours [d, E]). Every tensor of the checkpoint must be used and every parameter of ours found: anything else
raises `HFWeightsError` naming the file and the tensor.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from core.config import TransformerConfig
from experiments.hf import arch as arch_lib
from moe.config import MoEConfig

__all__ = ["Entry", "HFWeightsError", "check", "expert_names", "from_ours", "headers", "layout", "read", "to_ours"]

_FLOATS = ("float32", "float16", "bfloat16")


class HFWeightsError(ValueError):
    """A checkpoint's tensors do not fit: a missing shard or tensor, an unused tensor, a shape or dtype we cannot
    hold. The message names the file and the tensor."""


def read(hf_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in `hf_dir`: `model.safetensors`, or the shards `model.safetensors.index.json`
    lists (each tensor from the file the index names). Read with the safetensors NumPy API (bfloat16 as ml_dtypes').
    Raises HFWeightsError naming the first tensor that holds a NaN or Inf."""
    tensors: dict[str, np.ndarray] = {}
    for path, names in _shards(hf_dir).items():
        with _opened(path) as f:
            for name in names:
                tensors[name] = x = f.get_tensor(name)
                bad = x.size - int(np.count_nonzero(np.isfinite(x)))
                if bad:
                    raise HFWeightsError(
                        f"{path}: tensor {name!r} holds {bad:,} non-finite values (NaN or Inf) of {x.size:,}: the "
                        "checkpoint is damaged or was saved after training diverged; nothing was imported"
                    )
    return tensors


def headers(hf_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, dtype name)} of the checkpoint in `hf_dir`, from the safetensors headers alone (no
    tensor is read): what `check` needs to refuse a checkpoint before anything is loaded."""
    out = {}
    for path, names in _shards(hf_dir).items():
        with _opened(path) as f:
            for name in names:
                piece = f.get_slice(name)
                out[name] = (tuple(piece.get_shape()), _DTYPES.get(piece.get_dtype(), piece.get_dtype()))
    return out


@contextlib.contextmanager
def _opened(path: str) -> Iterator[Any]:
    """`safe_open(path)` (NumPy arrays) whose failures, on opening or on reading a tensor (a truncated or corrupt
    file), are one HFWeightsError naming the file."""
    from safetensors import SafetensorError, safe_open  # an optional dependency ([experiments]): imported here

    _regular(path)
    try:
        with safe_open(path, framework="np") as f:
            yield f
    except SafetensorError as e:
        raise HFWeightsError(
            f"{path}: not a readable safetensors file ({e}): it is truncated or damaged; copy or download it again"
        ) from None


def _regular(path: str) -> None:
    """Raises HFWeightsError unless `path` is a regular file (a FIFO or a device would block or never end)."""
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        raise HFWeightsError(f"{path}: not a regular file (a FIFO, a device or a socket); allowed: a safetensors file")


_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # safetensors' header names


def _shards(hf_dir: str) -> dict[str, list[str]]:
    """{shard file path: the tensor names it holds} of `hf_dir`. Raises HFWeightsError for a missing file or
    tensor."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        _regular(index)
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
    else:
        single = os.path.join(hf_dir, "model.safetensors")
        if not os.path.exists(single):
            raise HFWeightsError(f"{hf_dir}: neither model.safetensors nor model.safetensors.index.json is there")
        with _opened(single) as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    out: dict[str, list[str]] = {}
    for shard in sorted(set(weight_map.values())):
        path = os.path.join(hf_dir, shard)
        names = [n for n, s in weight_map.items() if s == shard]
        if not os.path.exists(path):
            raise HFWeightsError(
                f"{path}: the shard is missing (the index puts {len(names)} tensors there, e.g. {names[0]!r})"
            )
        with _opened(path) as f:
            present = set(f.keys())
        for name in names:
            if name not in present:
                raise HFWeightsError(f"{path}: tensor {name!r} listed in the index is not in the file")
        out[path] = names
    return out


class Entry(NamedTuple):
    """One checkpoint tensor: its name, its shape there, our parameter path, whether ours is its transpose
    (PyTorch's Linear stores [out, in]), and, for an expert's tensor, the expert's index in our [E, ...] stack."""

    hf: str
    shape: tuple[int, ...]
    ours: str
    transpose: bool = False
    expert: int | None = None


def layout(model: TransformerConfig, moe: MoEConfig, *, experts: arch_lib.ExpertNames | None = None) -> list[Entry]:
    """Every tensor of the Hugging Face checkpoint of a model with the config sections `model` and `moe`, mapped to
    ours: the one table import (`to_ours`) and export (`from_ours`) both read, from experiments.hf.arch (`TOP`,
    `LAYER`, `DENSE_MLP`, and `experts`: the MoE layers' names, default `arch.MLP_EXPERTS`)."""
    names = experts or arch_lib.MLP_EXPERTS
    out = [Entry(t.hf, t.shape(model), t.ours, t.transpose) for t in arch_lib.TOP if t.present(model)]
    for i in range(model.num_layers):
        hf, ours = f"model.layers.{i}", f"blocks.{i}"
        ffn = () if moe.is_moe_layer(i) else arch_lib.DENSE_MLP
        for t in (*arch_lib.LAYER, *ffn):
            if t.present(model):
                out.append(Entry(f"{hf}.{t.hf}", t.shape(model), f"{ours}.{t.ours}", t.transpose))
        if not moe.is_moe_layer(i):
            continue
        e, size, d, prefix = moe.num_experts, moe.expert_size, model.d_model, f"{hf}.{names.block}"
        out.append(Entry(f"{prefix}.{names.router}.weight", (e, d), f"{ours}.ffn.router", True))
        for j in range(e):
            for name, ours_name, shape in zip(
                (names.gate, names.up, names.down), ("gate", "up", "down"), ((size, d), (size, d), (d, size))
            ):
                out.append(Entry(f"{prefix}.experts.{j}.{name}.weight", shape, f"{ours}.ffn.{ours_name}", True, j))
        if moe.shared_expert_size:  # (Qwen2-MoE's: swiglu, named like the dense MLP)
            s, shared = moe.shared_expert_size, f"{prefix}.{arch_lib.SHARED_EXPERT}"
            for name, shape in (("gate", (s, d)), ("up", (s, d)), ("down", (d, s))):
                out.append(Entry(f"{shared}.{name}_proj.weight", shape, f"{ours}.ffn.shared_{name}.kernel", True))
            if moe.shared_expert_gate:
                out.append(Entry(f"{shared}_gate.weight", (1, d), f"{ours}.ffn.shared_scale.kernel", True))
    return out


def expert_names(found: Iterable[str]) -> arch_lib.ExpertNames | None:
    """The MoE layers' names of the architecture whose expert tensors appear among the tensor names `found`
    (None: none does, e.g. a dense checkpoint)."""
    found = list(found)
    for a in arch_lib.ARCHITECTURES:
        if a.experts is not None and any(f".{a.experts.block}.experts." in name for name in found):
            return a.experts
    return None


def check(
    found: Mapping[str, tuple[tuple[int, ...], str]], model: TransformerConfig, moe: MoEConfig, *, source: str
) -> list[Entry]:
    """The layout entries of a checkpoint whose tensors have the {name: (shape, dtype name)} `found` (`headers`),
    after checking it holds exactly the tensors of a model with the sections `model` and `moe`, each of its shape
    and a float dtype. Raises HFWeightsError naming `source` and the first tensor that does not fit."""
    entries = layout(model, moe, experts=expert_names(found))
    for entry in entries:
        if entry.hf not in found:
            raise HFWeightsError(f"{source}: tensor {entry.hf!r} is missing (expected shape {entry.shape})")
        shape, dtype = found[entry.hf]
        if dtype not in _FLOATS:
            raise HFWeightsError(f"{source}: tensor {entry.hf!r} has dtype {dtype}; supported: {', '.join(_FLOATS)}")
        if tuple(shape) != entry.shape:
            raise HFWeightsError(f"{source}: tensor {entry.hf!r} has shape {tuple(shape)}, expected {entry.shape}")
    unused = sorted(set(found) - {entry.hf for entry in entries})
    if unused:
        raise HFWeightsError(
            f"{source}: {len(unused)} tensors map to no parameter of the model its config.json describes, e.g. "
            f"{unused[:3]}"
        )
    return entries


def to_ours(tensors: Mapping[str, np.ndarray], model: TransformerConfig, moe: MoEConfig, *, source: str) -> dict:
    """{our parameter path: array} of a model with the config sections `model` and `moe`, from the checkpoint's
    `tensors`. Raises HFWeightsError for a missing or unused tensor, a wrong shape or dtype (`check`)."""
    entries = check({name: (x.shape, str(x.dtype)) for name, x in tensors.items()}, model, moe, source=source)
    out: dict[str, Any] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for entry in entries:
        x = tensors[entry.hf]
        x = np.ascontiguousarray(x.T) if entry.transpose else x
        if entry.expert is None:
            out[entry.ours] = x
        else:
            stacks.setdefault(entry.ours, {})[entry.expert] = x
    out.update({path: np.stack([parts[j] for j in sorted(parts)]) for path, parts in stacks.items()})
    return out


def from_ours(
    params: Mapping[str, np.ndarray],
    model: TransformerConfig,
    moe: MoEConfig,
    *,
    experts: arch_lib.ExpertNames | None = None,
) -> dict:
    """The inverse of `to_ours`: {checkpoint tensor name: array} from {our parameter path: array}, the MoE layers
    named by `experts` (the architecture's, experiments.hf.arch)."""
    out = {}
    for entry in layout(model, moe, experts=experts):
        x = np.asarray(params[entry.ours])
        x = x if entry.expert is None else x[entry.expert]
        out[entry.hf] = np.ascontiguousarray(x.T if entry.transpose else x)
    return out
