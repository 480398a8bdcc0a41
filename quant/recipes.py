"""Named 4-bit training recipes: per GEMM (fprop, dgrad, wgrad) the grid, block, scale and its selection, Hadamard
transform and rounding (`Gemm`); which layers stay in high precision (docs/ufp4.md, "The recipe" and "Baselines").

The three GEMMs of a layer y = x w (x: [tokens, K], w: [K, N]) and their contraction axes:
  fprop  y  = x w        contract K       operands x (nearest), w (nearest)
  dgrad  dx = dy w^T     contract N       operands dy (stochastic if `stochastic_dy`), w (nearest)
  wgrad  dw = x^T dy     contract tokens  operands x (nearest), dy (stochastic if `stochastic_dy`)
Each operand is quantised in blocks along its GEMM's contraction axis, after the same RHT on both operands when
that GEMM's `rht` is on.

  NONE           no quantisation: the GEMMs in the operands' own dtype (float32 for a float32 model)
  BF16           no 4-bit grid: every GEMM's operands cast to bfloat16, products accumulated in float32 (the
                 usual bf16 mixed-precision baseline; the layers kept in high precision below stay unrounded)
  E2M1_BASELINE  e2m1, 1x16 blocks, FP32 amax scale, RHT on wgrad only, SR on dy (the paper's E2M1 reference)
  UFP4           e1m2 (uniform), 1x16, FP32 amax scale, RHT16 on all three GEMMs, SR on dy (the paper's recipe)
  UFP4_INT4      the same with int4 levels (-7..7): with an FP32 amax scale the same grid as e1m2
  NVFP4          NVIDIA's recipe (arXiv 2509.25149): nvfp4 (E2M1, E4M3 16-blocks under an FP32 tensor scale),
                 16x16 2-D blocks for weights (fprop, dgrad), RHT16 on wgrad only, SR on dy; its last blocks in BF16
                 are `last_blocks_high_precision` (off here, as in every preset)
  NVFP4_4OVER6   the same with "4 over 6" scale selection on every operand (arXiv 2512.02010)
  MXFP4          mxfp4 (E2M1, 32-blocks, UE8M0 scale), no RHT, SR on dy (the OCP baseline)
  MXFP4_AMD      AMD's recipe (arXiv 2605.09825): mxfp4 on all three GEMMs, a deterministic 16-point Hadamard
                 (no random signs) on wgrad only, nearest rounding everywhere (SR and random rotations failed there)
  GRIDGAMES      NVFP4 with Grid Games selection on every operand (arXiv 2605.12327): per 16-block e2m1 or int4,
                 whichever has the smaller squared error, signalled in the E4M3 scale's spare sign bit
  NVFP4_MS_EDEN  NVFP4's fprop; dgrad and wgrad rotate both operands with fresh random-sign Hadamards of 128 and
                 round dy by MS-EDEN (Quartet II, arXiv 2601.22813; quant.quantize), the other operand nearest.
                 Differs from Quartet II: its fprop adds 4 over 6 there optionally, and it re-quantises both
                 backward operands with MS-EDEN and maps amax to 6 / 0.988 (a slight clip) in the backward pass
Layers kept in high precision by default (regex on the module path, NVFP4's choice where the paper is silent):
the LM head, MoE routers, embeddings; attention's score and value products never pass through the slot.
"""

from __future__ import annotations

import dataclasses
import re

from quant.grids import FORMATS, scale_of

__all__ = [
    "BF16",
    "DY_ROUNDINGS",
    "E2M1_BASELINE",
    "GRIDGAMES",
    "MXFP4",
    "MXFP4_AMD",
    "NONE",
    "NVFP4",
    "NVFP4_4OVER6",
    "NVFP4_MS_EDEN",
    "RECIPES",
    "RHT_SIGNS",
    "UFP4",
    "UFP4_INT4",
    "Gemm",
    "Recipe",
    "get",
]

HIGH_PRECISION = (r"(^|\.)head$", r"\.router$", r"embed")
GEMM_DTYPES = (None, "bfloat16", "float16", "float32")


RHT_SIGNS = ("random", "none")
DY_ROUNDINGS = ("nearest", "stochastic", "ms_eden")


@dataclasses.dataclass(frozen=True)
class Gemm:
    """How one GEMM quantises its operands (fmt None: not quantised, and no other field may be set).

    fmt: the element grid and its default scale and block (quant.grids.FORMATS); block_size: elements per block
    along the contraction axis (None: the format's default, 16; 32 for mxfp4); scale: the block scales' encoding
    (None: the format's own; "fp32", "e4m3" under an FP32 tensor scale, "ue8m0"); select: "max" or "4over6"
    (quant.grids); rht: rotate both operands along the contraction axis by a blockwise Hadamard transform of
    `rht_block` (a power of 2) with random signs (`rht_signs` "random": the run's or fresh ones, see Recipe) or none
    ("none": the deterministic H / sqrt(b)); dy_rounding: how the dy operand (dgrad, wgrad) rounds, one of
    DY_ROUNDINGS: "nearest", "stochastic" (per element) or "ms_eden" (nearest elements, stochastic EDEN-corrected
    block scales per rotation group, quant.quantize; needs rht with random signs, fp32 or e4m3 scales and select
    "max"; unbiased over the rotation only when its signs are fresh per call: the recipe's `fresh_signs`); None:
    "stochastic" if `stochastic_dy` else "nearest". stochastic_dy: kept for the older spelling; after construction
    it reads True exactly when dy_rounding draws randomness (stochastic_dy=True with dy_rounding "nearest" is a
    ValueError); weight_2d: the weight operand (fprop, dgrad) in block x block tiles, one scale per tile, so that w
    and w^T quantise alike (NVFP4). ValueError naming the field, the value and what is allowed."""

    fmt: str | None = None
    block_size: int | None = None
    scale: str | None = None
    select: str = "max"
    rht: bool = False
    rht_block: int = 16
    rht_signs: str = "random"
    stochastic_dy: bool = False
    weight_2d: bool = False
    dy_rounding: str | None = None

    def __post_init__(self):
        if self.fmt is None:
            set_ = [f.name for f in dataclasses.fields(self) if f.name != "fmt" and getattr(self, f.name) != f.default]
            if set_:
                raise ValueError(f"Gemm.fmt = None (not quantised) with {set_} set; give a fmt or leave them unset.")
            return
        if self.fmt not in FORMATS:
            raise ValueError(f"Gemm.fmt = {self.fmt!r}; allowed: None or one of {list(FORMATS)}.")
        try:
            scale_of(self.fmt, self.scale, self.select)
        except ValueError as e:
            raise ValueError(f"Gemm (fmt {self.fmt!r}): {e}") from None
        if self.block_size is not None and (isinstance(self.block_size, bool) or self.block_size < 1):
            raise ValueError(f"Gemm.block_size = {self.block_size!r}; allowed: None or a positive integer.")
        if self.rht_block < 2 or self.rht_block & (self.rht_block - 1):
            raise ValueError(f"Gemm.rht_block = {self.rht_block} must be a power of 2 >= 2.")
        if self.rht_signs not in RHT_SIGNS:
            raise ValueError(f"Gemm.rht_signs = {self.rht_signs!r}; allowed: {list(RHT_SIGNS)}.")
        if self.weight_2d and self.rht:
            raise ValueError(
                "Gemm.weight_2d = True with rht = True: the rotation runs along the contraction axis only, so w and "
                "w^T would no longer quantise alike; choose one."
            )
        rounding = self.dy_rounding
        if rounding is None:
            rounding = "stochastic" if self.stochastic_dy else "nearest"
        if rounding not in DY_ROUNDINGS:
            raise ValueError(f"Gemm.dy_rounding = {rounding!r}; allowed: None or one of {list(DY_ROUNDINGS)}.")
        if self.stochastic_dy and rounding == "nearest":
            raise ValueError("Gemm.stochastic_dy = True with dy_rounding = 'nearest'; give one of them.")
        if rounding == "ms_eden" and (
            not self.random_rotation or self.select != "max" or scale_of(self.fmt, self.scale) == "ue8m0"
        ):
            raise ValueError(
                f"Gemm.dy_rounding = 'ms_eden' (fmt {self.fmt!r}, scale {self.scale!r}, select {self.select!r}, rht "
                f"{self.rht}, rht_signs {self.rht_signs!r}): it needs rht = True with random signs (EDEN's correction "
                "is unbiased over a random rotation), fp32 or e4m3 scales and select = 'max'."
            )
        object.__setattr__(self, "dy_rounding", rounding)
        object.__setattr__(self, "stochastic_dy", rounding != "nearest")

    @property
    def random_rotation(self) -> bool:
        """True if this GEMM rotates its operands with random signs (its RHT's draw: the run's seed or a key)."""
        return self.fmt is not None and self.rht and self.rht_signs == "random"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A training recipe: the three GEMMs (wgrad has no weight operand: its weight_2d must stay False), the dtype
    the GEMMs multiply in
    (`gemm_dtype`: both operands of every GEMM cast to it after any 4-bit quantisation, products accumulated in
    float32; None: the operands' own dtype), and which module paths stay in high precision (`high_precision`
    regexes, searched in the path; `last_blocks_high_precision` keeps the last n transformer blocks too)."""

    name: str
    fprop: Gemm = Gemm()
    dgrad: Gemm = Gemm()
    wgrad: Gemm = Gemm()
    high_precision: tuple[str, ...] = HIGH_PRECISION
    last_blocks_high_precision: int = 0
    fresh_signs: bool = False  # RHT signs drawn per call from the layer's key (default: fixed for the run, drawn
    # from the run's seed that QuantPrecision receives)
    gemm_dtype: str | None = None

    def __post_init__(self):
        if self.gemm_dtype not in GEMM_DTYPES:
            raise ValueError(f"Recipe.gemm_dtype = {self.gemm_dtype!r}; allowed: {list(GEMM_DTYPES)}.")
        if self.wgrad.weight_2d:
            raise ValueError(f"recipe {self.name}: wgrad.weight_2d = True, but wgrad (x^T dy) has no weight operand.")

    @property
    def quantised(self) -> bool:
        """True if some GEMM changes its operands (a 4-bit grid or a cast to `gemm_dtype`); False for NONE, whose
        GEMMs are plain jax.lax.dot_general / ragged_dot."""
        return self.gemm_dtype is not None or any(g.fmt is not None for g in (self.fprop, self.dgrad, self.wgrad))

    @property
    def needs_key(self) -> bool:
        """True if differentiating a GEMM of this recipe draws randomness (stochastic rounding of dy, fresh RHT
        signs), so that the custom dot_general / grouped matmul need a PRNG key to be trained."""
        gemms = (self.fprop, self.dgrad, self.wgrad)
        return any(g.fmt is not None and (g.stochastic_dy or (self.fresh_signs and g.random_rotation)) for g in gemms)

    def keeps(self, path: str, num_layers: int | None = None) -> bool:
        """True if the module at `path` ("blocks.3.attn.q") stays in high precision."""
        if any(re.search(p, path) for p in self.high_precision):
            return True
        n = self.last_blocks_high_precision
        if n:
            if num_layers is None:
                raise ValueError(f"recipe {self.name}: last_blocks_high_precision = {n} needs the number of layers.")
            match = re.match(r"blocks\.(\d+)\.", path)
            return match is not None and int(match.group(1)) >= num_layers - n
        return False


def _all(fmt: str, *, rht: tuple[bool, bool, bool]) -> tuple[Gemm, Gemm, Gemm]:
    """(fprop, dgrad, wgrad) on the grid `fmt` with the given RHT per GEMM and stochastic rounding of dy."""
    return Gemm(fmt, rht=rht[0]), Gemm(fmt, rht=rht[1], stochastic_dy=True), Gemm(fmt, rht=rht[2], stochastic_dy=True)


NONE = Recipe("none")
BF16 = Recipe("bf16", gemm_dtype="bfloat16")
E2M1_BASELINE = Recipe("e2m1_baseline", *_all("e2m1", rht=(False, False, True)))
UFP4 = Recipe("ufp4", *_all("e1m2", rht=(True, True, True)))
UFP4_INT4 = Recipe("ufp4_int4", *_all("int4", rht=(True, True, True)))
NVFP4 = Recipe(
    "nvfp4",
    Gemm("nvfp4", weight_2d=True),
    Gemm("nvfp4", stochastic_dy=True, weight_2d=True),
    Gemm("nvfp4", rht=True, stochastic_dy=True),
)
NVFP4_4OVER6 = Recipe(
    "nvfp4_4over6",
    fprop=dataclasses.replace(NVFP4.fprop, select="4over6"),
    dgrad=dataclasses.replace(NVFP4.dgrad, select="4over6"),
    wgrad=dataclasses.replace(NVFP4.wgrad, select="4over6"),
)
MXFP4 = Recipe("mxfp4", *_all("mxfp4", rht=(False, False, False)))
MXFP4_AMD = Recipe("mxfp4_amd", Gemm("mxfp4"), Gemm("mxfp4"), Gemm("mxfp4", rht=True, rht_signs="none"))
GRIDGAMES = Recipe(
    "gridgames",
    fprop=dataclasses.replace(NVFP4.fprop, select="grid"),
    dgrad=dataclasses.replace(NVFP4.dgrad, select="grid"),
    wgrad=dataclasses.replace(NVFP4.wgrad, select="grid"),
)
NVFP4_MS_EDEN = Recipe(
    "nvfp4_ms_eden",
    NVFP4.fprop,
    Gemm("nvfp4", rht=True, rht_block=128, dy_rounding="ms_eden"),
    Gemm("nvfp4", rht=True, rht_block=128, dy_rounding="ms_eden"),
    fresh_signs=True,
)
RECIPES = {
    r.name: r
    for r in (
        NONE,
        BF16,
        E2M1_BASELINE,
        UFP4,
        UFP4_INT4,
        NVFP4,
        NVFP4_4OVER6,
        MXFP4,
        MXFP4_AMD,
        GRIDGAMES,
        NVFP4_MS_EDEN,
    )
}


def get(name: str) -> Recipe:
    """The recipe named `name` (a key of RECIPES); ValueError naming the allowed names otherwise."""
    if name not in RECIPES:
        raise ValueError(f"recipe = {name!r}; allowed: {list(RECIPES)}.")
    return RECIPES[name]
