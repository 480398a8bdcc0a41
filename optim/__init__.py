"""MGUP (arXiv 2606.17526): momentum-gradient alignment selective updates as optax transforms; outer optimizers.

from optim import mgup_adamw, cautious_mgup_adamw, mgup_lion, mgup_muon, cautious_adamw, diloco_outer
"""

from optim.mgup import (
    cautious_adamw,
    cautious_mgup_adamw,
    mgup_adamw,
    mgup_lion,
    mgup_mask,
    paper_defaults,
    scale_by_hf_adam,
    scale_by_lion_direction,
    scale_by_mgup,
    with_mgup,
)
from optim.muon import mgup_muon, newton_schulz, scale_by_muon
from optim.outer import diloco_outer

__all__ = [
    "cautious_adamw",
    "cautious_mgup_adamw",
    "diloco_outer",
    "mgup_adamw",
    "mgup_lion",
    "mgup_mask",
    "mgup_muon",
    "newton_schulz",
    "paper_defaults",
    "scale_by_hf_adam",
    "scale_by_lion_direction",
    "scale_by_mgup",
    "scale_by_muon",
    "with_mgup",
]
