"""MGUP (arXiv 2606.17526): momentum-gradient alignment selective updates as optax transforms; outer optimizers.

from optim import mgup_adamw, cautious_mgup_adamw, mgup_lion, mgup_muon, cautious_adamw, diloco_outer

Algorithms: docs/mgup.md. Every optimizer takes the learning rate first and everything else by keyword;
`state_metrics(opt_state)` gives the metrics an MGUP state holds (the selected fraction).
"""

from optim.mgup import (
    DirectionFn,
    DirectionTransformation,
    MGUPChainState,
    MGUPState,
    cautious_adamw,
    cautious_mgup_adamw,
    mgup_adamw,
    mgup_lion,
    mgup_mask,
    num_selected,
    paper_defaults,
    scale_by_cautious,
    scale_by_hf_adam,
    scale_by_lion_direction,
    scale_by_mgup,
    state_metrics,
    with_mgup,
)
from optim.muon import MuonState, mgup_muon, newton_schulz, scale_by_muon
from optim.outer import diloco_outer

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
