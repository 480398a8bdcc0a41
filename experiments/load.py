"""Loading a trained model back from a run's workdir (config.json, data.json and the latest checkpoint).

    config, model = load.trained_model("runs/quickstart")
    config, model = load.trained_model("runs/composed", site=1)

A federated run's checkpoint holds one model per site (its resident experts and, with partitioned routing, its
router): `site` picks which one (default 0, the one the run's own sample uses). It loads on one device whatever
devices the run trained on.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import jax
import ml_collections
from flax import nnx

if TYPE_CHECKING:
    from core.model import Transformer

__all__ = ["run_config", "trained_model"]


def trained_model(workdir: str, *, site: int = 0) -> tuple[ml_collections.ConfigDict, Transformer]:
    """(config, model with the latest checkpoint's parameters) of the run in `workdir`; for a federated run, site
    `site`'s model and the config describing it as a model of its own (`experiments.federated.site_config`).

    Raises FileNotFoundError naming what is missing, or ValueError for a site the run does not have.
    """
    from core import checkpoint as checkpoint_lib
    from core import train as train_lib
    from experiments import build

    paths = {name: os.path.join(workdir, name) for name in ("config.json", "data.json", "checkpoints")}
    missing = [p for p in paths.values() if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(
            f"{workdir} is not a finished run's workdir: missing {missing} (train one with "
            "`python -m experiments.run --config ... --workdir ...`)"
        )
    config = run_config(workdir)
    sites = config.mesh.site
    if not 0 <= site < sites:
        raise ValueError(f"site = {site}: the run in {workdir} has mesh.site = {sites} site(s); allowed 0..{sites - 1}")
    with open(paths["data.json"]) as f:
        fingerprint = json.load(f)["fingerprint"]
    checkpointer = checkpoint_lib.Checkpointer(paths["checkpoints"])
    step = checkpointer.latest_step()
    if step is None:
        raise FileNotFoundError(f"{paths['checkpoints']} holds no checkpoint")
    compat = build.checkpoint_compat(config, fingerprint)
    if sites > 1:
        from experiments import federated

        graphdef, _, _, state = federated.initial_state(config)  # [sites, ...] on this process's first device
        state, _ = checkpointer.restore(step, state, compat=compat)
        train = jax.tree.map(lambda x: x[site], state.train)
        config = federated.site_config(config)  # the site's model as a model of its own
    else:
        config.mesh.data = 1  # one device is enough to hold the parameters for inference
        build.validate(config, num_devices=1)
        _, sharder = build.build_mesh(config)
        graphdef, train = train_lib.init_state(
            build.build_model_fn(config, sharder), build.build_optimizer(config), config.train.seed, sharder
        )
        train, _ = checkpointer.restore(step, train, compat=compat)
    checkpointer.close()
    return config, nnx.merge(graphdef, train.params, train.rest)


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """The resolved config a run in `workdir` trained with (its config.json over today's defaults: sections and keys
    added since the run was trained keep their defaults)."""
    from experiments import build

    config = build.default_config()
    with open(os.path.join(workdir, "config.json")) as f:
        for section, values in json.load(f).items():
            config[section].update(
                {k: _tuples(v) if isinstance(config[section][k], tuple) else v for k, v in values.items()}
            )
    return config


def _tuples(value):
    """JSON lists back to the tuples the config declared (mesh rules are hashed as static jit arguments)."""
    return tuple(map(_tuples, value)) if isinstance(value, list) else value
