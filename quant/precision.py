"""The model's matmul-precision slot filled by a quant recipe (core.model.Precision, duck-typed).

`QuantPrecision(recipe, num_layers=L)`: every projection whose path the recipe does not keep in high precision gets
`quant.dot_general(recipe, key=layer key)`; kept paths (the head, routers, ...; see Recipe.keeps) and the
unquantised BF16 recipe get `jax.lax.dot_general`. Experts get `quant.grouped_matmul(recipe, key=...)` around
`grouped` (the MoE package's grouped matmul).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from quant.dot_general import dot_general
from quant.grouped import grouped_matmul
from quant.recipes import Recipe

__all__ = ["QuantPrecision"]


@dataclasses.dataclass(frozen=True)
class QuantPrecision:
    recipe: Recipe
    num_layers: int | None = None
    grouped: Callable = jax.lax.ragged_dot

    def _keeps(self, path: str) -> bool:
        return not self.recipe.quantised or self.recipe.keeps(path, self.num_layers)

    def dot_general(self, path: str, key: jax.Array | None) -> Callable:
        return jax.lax.dot_general if self._keeps(path) else dot_general(self.recipe, key=key)

    def grouped_matmul(self, path: str, key: jax.Array | None) -> Callable:
        return self.grouped if self._keeps(path) else grouped_matmul(self.recipe, key=key, inner=self.grouped)
