"""The model's matmul-precision slot filled by a quant recipe (core.model.Precision, duck-typed).

`QuantPrecision(recipe, num_layers=L)`: every projection whose path the recipe does not keep in high precision gets
`quant.make_dot_general(recipe, key=layer key)`; kept paths (the head, routers, ...; see Recipe.keeps) and the
unquantised NONE recipe get `jax.lax.dot_general` (so BF16 rounds the operands of every GEMM to bfloat16 except
the kept paths'). Experts get `quant.make_grouped_matmul(recipe, key=...)` around `grouped` (the MoE package's grouped
matmul). `seed` (the run's `train.seed`) fixes the RHT signs of every GEMM
(`quant.hadamard.run_signs(seed)`; default 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from quant.gemm import make_dot_general
from quant.grouped import make_grouped_matmul
from quant.recipes import Recipe

__all__ = ["QuantPrecision"]


@dataclasses.dataclass(frozen=True)
class QuantPrecision:
    """The precision slot of a quant recipe.

    Attributes:
      recipe: the training recipe (quant.recipes).
      num_layers: the model's number of transformer blocks (for `recipe.last_blocks_high_precision`).
      grouped: the MoE's grouped matmul, which the quantised expert GEMMs multiply through.
      seed: the run's seed, from which the fixed RHT signs are drawn.
    """

    recipe: Recipe
    num_layers: int | None = None
    grouped: Callable = jax.lax.ragged_dot
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"QuantPrecision.seed = {self.seed!r}; allowed: an integer >= 0.")

    def _keeps(self, path: str) -> bool:
        return not self.recipe.quantised or self.recipe.keeps(path, self.num_layers)

    def dot_general(self, path: str, key: jax.Array | None) -> Callable:
        """The dot_general of the module at `path` for this step (`key`: its layer key, None for inference)."""
        return jax.lax.dot_general if self._keeps(path) else make_dot_general(self.recipe, key=key, seed=self.seed)

    def grouped_matmul(self, path: str, key: jax.Array | None) -> Callable:
        """The grouped matmul of the experts at `path` for this step."""
        if self._keeps(path):
            return self.grouped
        return make_grouped_matmul(self.recipe, key=key, inner=self.grouped, seed=self.seed)
