"""A Hugging Face config.json -> our `model` and `moe` config sections, refusing what we cannot honour.

    sections = config_map.from_hf(json.load(open("config.json")), source="ckpt/config.json")
    # {"model": {...}, "moe": {...}}: set these on a default config (experiments.schema.default_config())

The mapping is the architecture's entry in experiments.hf.arch, the table export writes from too. Every key of the
file is accounted for: mapped to one of ours (the entry's keys, the RoPE keys), checked to hold the only value we
implement (`arch.EXPECTED`: e.g. `hidden_act` "silu", `attention_dropout` 0), or known to describe nothing the
forward pass depends on (`arch.IRRELEVANT`: token ids, initialiser, dtype, cache flags). Any other key, or a value
we do not implement, raises `HFConfigError` naming the file, the key and its value, before any weight is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core import schema as schema_lib
from core.config import TransformerConfig
from experiments.hf import arch as arch_lib
from moe.config import MoEConfig

__all__ = ["ARCHITECTURES", "HFConfigError", "from_hf"]

ARCHITECTURES = tuple(a.name for a in arch_lib.ARCHITECTURES)
"""The `architectures[0]` values we import (experiments.hf.arch)."""


_FIELDS = {"model": schema_lib.section_fields(TransformerConfig), "moe": schema_lib.section_fields(MoEConfig)}


class HFConfigError(ValueError):
    """A config.json field we cannot honour; the message names the file, the field and its value."""


def from_hf(hf: Mapping[str, Any], *, source: str) -> dict[str, dict[str, Any]]:
    """Our `model` and `moe` sections for the checkpoint whose config.json is `hf` (`source` names the file in
    errors). Raises HFConfigError for an unsupported architecture, an unknown field or an unsupported value."""

    def fail(key: str, why: str) -> HFConfigError:
        return HFConfigError(f"{source}: {key} = {hf.get(key)!r}: {why}")

    entry = arch_lib.get((hf.get("architectures") or [None])[0])
    if entry is None:
        raise fail("architectures", f"supported: {', '.join(ARCHITECTURES)}")
    sections: dict[str, dict[str, Any]] = {"model": {}, "moe": {}}

    def put(ours: str, value: Any) -> None:
        section, key = ours.split(".")
        sections[section][key] = value

    fixed = [*arch_lib.COMMON_FIXED, arch_lib.DENSE_FIXED, *(arch_lib.MOE_FIXED if entry.moe else ()), *entry.fixed]
    for f in fixed:
        put(f.ours, f.value)
    if not entry.moe:
        put("moe.every", 0)
    used = set(arch_lib.ROPE_KEYS)
    for mapped in entry.all_keys():
        names = (mapped.hf, *mapped.aliases)
        used.update(names)
        present = next((hf[n] for n in names if hf.get(n) is not None), None)
        if present is None and mapped.default is arch_lib.REQUIRED:
            raise fail(mapped.hf, "a required field is missing")
        default = mapped.default(hf) if callable(mapped.default) else mapped.default
        for ours in (mapped.ours, *mapped.also):
            value = mapped.read(default if present is None else present)
            section, key = ours.split(".")
            try:  # our key's type and range: num_hidden_layers = -1 is no model
                _FIELDS[section][key].check(ours, value)
            except schema_lib.ConfigError as e:
                raise fail(mapped.hf, f"it maps to our {e}") from None
            put(ours, value)
    if entry.moe:
        for ours, value in arch_lib.MOE_KNOBS.items():
            put(ours, value)
    sections["model"].update(arch_lib.rope_from_hf(hf, fail))
    for key, value in hf.items():
        if key in used or key in arch_lib.IRRELEVANT:
            continue
        if key not in arch_lib.EXPECTED:
            raise fail(key, "a field this importer does not know; it may change the model, so it is refused")
        ok, why = arch_lib.EXPECTED[key]
        if not ok(value, hf):
            raise fail(key, why)
    return sections
