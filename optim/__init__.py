"""MGUP (arXiv 2606.17526): momentum-gradient alignment selective updates as optax transforms; outer optimizers.

from optim import mgup_adamw, cautious_mgup_adamw, mgup_lion, mgup_muon, cautious_adamw, diloco_outer

Modules: transform (the MGUP mask `scale_by_mgup`, the directions, `with_mgup`, their states), alias (the presets),
select (which coordinates get alpha), muon (Muon and MGUP-Muon), outer (DiLoCo). The optimizers an experiment
config can name, and its `optim` section, are experiments.optimizers' and experiments.schema_optim's. Algorithms:
docs/mgup.md. Every optimizer takes the learning rate first and everything else by keyword;
`state_metrics(opt_state)` gives the metrics an MGUP state holds (the selected fraction).
"""

from optim.alias import cautious_adamw, cautious_mgup_adamw, mgup_adamw, mgup_lion, paper_defaults
from optim.muon import MuonState, mgup_muon, newton_schulz, scale_by_muon
from optim.outer import diloco_outer
from optim.select import num_selected
from optim.transform import (
    DirectionFn,
    DirectionTransformation,
    MGUPChainState,
    MGUPState,
    mgup_mask,
    scale_by_cautious,
    scale_by_hf_adam,
    scale_by_lion_direction,
    scale_by_mgup,
    state_metrics,
    with_mgup,
)

__all__ = [
    "DirectionFn",
    "DirectionTransformation",
    "MGUPChainState",
    "MGUPState",
    "MuonState",
    "cautious_adamw",
    "cautious_mgup_adamw",
    "diloco_outer",
    "mgup_adamw",
    "mgup_lion",
    "mgup_mask",
    "mgup_muon",
    "newton_schulz",
    "num_selected",
    "paper_defaults",
    "scale_by_cautious",
    "scale_by_hf_adam",
    "scale_by_lion_direction",
    "scale_by_mgup",
    "scale_by_muon",
    "state_metrics",
    "with_mgup",
]
