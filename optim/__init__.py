"""MGUP (arXiv 2606.17526): momentum-gradient alignment selective updates as optax transforms."""
