"""A typed, checked section of settings: a frozen dataclass whose keys are declared once with `field` (default,
accepted types from the annotation, allowed choices or range, one line of documentation), and what reads the
declaration: `section_fields` (key -> `Field`, whose `check` refuses a value naming the key, the value and what is
allowed) and `from_config` (the dataclass holding a mapping's values, refusing a key it does not declare).

Pure Python, no configuration library: the library packages declare their own typed arguments with it (moe.config's
`MoEConfig`), and the experiment config's sections (core.config, experiments/schema*.py) are declared the same way;
core.schema builds the `ml_collections.ConfigDict` machinery on top.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_WIDTH",
    "Compat",
    "ConfigError",
    "Field",
    "field",
    "from_config",
    "section_fields",
    "unknown_key_error",
]

MAX_WIDTH = 2**20
"""The largest value of a model's size keys (vocabulary, widths, heads, layers, experts): 1,048,576, above any published
model's (their widths and vocabularies are at most a few 100,000). It keeps every weight's element count far inside
the 64 bits XLA counts it in (past them XLA aborts the process instead of raising), and a config.json edited to a
huge width is refused by name instead of failing later as something else."""


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
      since_checkpoints: a key added after checkpoints were written: `checkpoint_compat` leaves it out at its
        default, so those checkpoints (written before it existed, i.e. with its default behaviour) still resume.
    """

    default: Any
    types: tuple[type, ...]
    doc: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    since_checkpoints: bool = False

    def check(self, key: str, value: Any) -> None:
        """Raises ConfigError if `value` is not an acceptable value for `key`."""
        if not _has_type(value, self.types):
            raise ConfigError(
                f"config key '{key}' = {value!r} has type {type(value).__name__}; expected {_names(self.types)}."
            )
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"config key '{key}' = {value!r} is not one of the allowed values {list(self.choices)}.")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, int) and not -(2**63) <= value < 2**63:
                raise ConfigError(
                    f"config key '{key}' = {value!r} does not fit a 64-bit integer (array shapes and sizes are 64-bit):"
                    f" allowed {self.describe()}."
                )
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"config key '{key}' = {value!r} must be a finite number.")
            if isinstance(value, float) and abs(value) > _FLOAT32_MAX:  # inf once training casts it
                raise ConfigError(
                    f"config key '{key}' = {value!r} is not finite in float32, the dtype training computes in: "
                    f"allowed |value| <= {_FLOAT32_MAX:.1e}."
                )
            too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
            too_high = self.high is not None and value > self.high
            if too_low or too_high:
                raise ConfigError(f"config key '{key}' = {value!r} is outside the allowed range {self._range()}.")

    def _range(self) -> str:
        lo = "(-inf" if self.low is None else ("(" if self.low_open else "[") + _number(self.low)
        hi = "inf)" if self.high is None else f"{_number(self.high)}]"
        return f"{lo}, {hi}"

    def describe(self) -> str:
        """What is allowed, in words (for docs)."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        kinds = _names(tuple(t for t in self.types if t is not type(None)))
        if self.low is not None or self.high is not None:
            kinds = f"{kinds} in {self._range()}"
        return f"{kinds} or None" if type(None) in self.types else kinds


_FLOAT32_MAX = 3.4028234663852886e38  # float(numpy.finfo(numpy.float32).max): the largest finite float32


def _number(x: float) -> str:
    """A bound as docs show it: a whole number in full with thousands separators (1,048,576), else `:g` (0.5, 1e-08)."""
    return f"{int(x):,}" if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


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
    since_checkpoints: bool = False,
) -> Any:
    """Declares one key of a config section: a dataclass field whose metadata holds its documentation and rules.

    The accepted types come from the field's annotation (`int`, `float`, `str`, `bool`, `tuple[...]`, or one of
    them `| None`), so a section is declared once, as a frozen dataclass:

        @dataclasses.dataclass(frozen=True)
        class TrainConfig:
            compat: ClassVar[Compat] = False
            steps: int = field(1000, "optimizer steps", low=1)
    """
    rules = {
        "doc": doc,
        "choices": choices,
        "low": low,
        "high": high,
        "low_open": low_open,
        "since_checkpoints": since_checkpoints,
    }
    return dataclasses.field(default=default, metadata={_RULES: rules})


_RULES = "core.fields"  # the metadata key of a field's rules

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
            raise TypeError(f"{section.__name__}.{f.name} is not declared with core.fields.field(...).")
        out[f.name] = Field(f.default, _types(hints[f.name], f"{section.__name__}.{f.name}"), **f.metadata[_RULES])
    return out


_S = typing.TypeVar("_S")


def from_config(section: type[_S], values: Mapping[str, Any]) -> _S:
    """The section dataclass holding a config section's values (lists become tuples: ConfigDict and the command
    line may turn tuples into lists). Raises ConfigError naming a key the section does not declare."""
    items = values.to_dict() if hasattr(values, "to_dict") else dict(values)  # a ConfigDict, or a plain mapping
    known = [f.name for f in dataclasses.fields(section)]  # type: ignore[arg-type]
    for key in items:
        if key not in known:
            raise unknown_key_error(key, known)
    return section(**{k: _tuples(v) for k, v in items.items()})


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def unknown_key_error(key: str, known: list[str]) -> ConfigError:
    """The error for an unknown key, suggesting the closest known keys."""
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return ConfigError(f"unknown config key '{key}'.{hint} Known keys: {', '.join(sorted(known))}.")
