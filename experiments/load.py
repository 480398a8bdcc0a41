"""Loading a trained model back from a run's workdir (config.json, data.json and the latest checkpoint).

    config, model = load.trained_model("runs/quickstart")

Single-device runs only: a federated run's checkpoint holds one model per site (their experts differ), so
`trained_model` refuses it with the key to change.
"""

from __future__ import annotations

import json
import os

import ml_collections
from flax import nnx

__all__ = ["trained_model"]


def trained_model(workdir: str) -> tuple[ml_collections.ConfigDict, nnx.Module]:
    """(config, model with the latest checkpoint's parameters) of the run in `workdir`.

    Raises FileNotFoundError naming what is missing, or ValueError for a federated run.
    """
    from core import checkpoint as checkpoint_lib
    from core import train as train_lib
    from experiments import build

    paths = {name: os.path.join(workdir, name) for name in ("config.json", "data.json", "checkpoints")}
    missing = [p for p in paths.values() if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"{workdir} is not a finished run's workdir: missing {missing} (train one with "
                                "`python -m experiments.run --config ... --workdir ...`)")
    config = build.default_config()  # sections added since the run was trained keep their defaults
    with open(paths["config.json"]) as f:
        for section, values in json.load(f).items():
            config[section].update({k: _tuples(v) if isinstance(config[section][k], tuple) else v
                                    for k, v in values.items()})
    if config.mesh.site > 1:
        raise ValueError(f"{workdir} is a federated run (mesh.site = {config.mesh.site}): its checkpoint holds one "
                         "model per site; load a single-site run (mesh.site = 1)")
    config.mesh.data = 1  # one device is enough to hold the parameters for inference
    build.validate(config, num_devices=1)
    with open(paths["data.json"]) as f:
        fingerprint = json.load(f)["fingerprint"]
    _, sharder = build.build_mesh(config)
    optimizer = build.build_optimizer(config)
    graphdef, state = train_lib.init_state(build.build_model_fn(config, sharder), optimizer, config.train.seed,
                                           sharder)
    checkpointer = checkpoint_lib.Checkpointer(paths["checkpoints"])
    step = checkpointer.latest_step()
    if step is None:
        raise FileNotFoundError(f"{paths['checkpoints']} holds no checkpoint")
    state, _ = checkpointer.restore(step, state, compat=train_lib.checkpoint_compat(config, fingerprint))
    checkpointer.close()
    return config, nnx.merge(graphdef, state.params, state.rest)


def _tuples(value):
    """JSON lists back to the tuples the config declared (mesh rules are hashed as static jit arguments)."""
    return tuple(map(_tuples, value)) if isinstance(value, list) else value
