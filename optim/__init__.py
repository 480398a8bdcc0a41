"""MGUP (arXiv 2606.17526): momentum-gradient alignment selective updates as optax transforms; outer optimizers.

    from optim import diloco_outer
"""

from optim.outer import diloco_outer

__all__ = ["diloco_outer"]
