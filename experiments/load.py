"""Loading a trained model back from a run's workdir (config.json, data.json and the latest checkpoint).

    config, model = load.trained_model("runs/quickstart")
    config, model = load.trained_model("runs/composed", site=1)
    config, model = load.trained_model("runs/ufp4", precision="float")      # float GEMMs, as its export computes

A federated run's checkpoint holds one model per site (its resident experts and, with partitioned routing, its
router): `site` picks which one (default 0, the one the run's own sample uses). It loads on one device whatever
devices the run trained on: the checkpoint's arrays (sharded by data, tensor (mesh.model) or expert (mesh.expert)
parallelism) are restored onto this process's first device, and the returned config describes that one-device
mesh (mesh.data = mesh.expert = mesh.model = 1, one process).
"""

from __future__ import annotations

import json
import os

import jax
import ml_collections
from flax import nnx

from core import checkpoint as checkpoint_lib
from core import config as config_lib
from core import fields as fields_lib
from core import schema as core_schema
from core import train as train_lib
from core import workdir as workdir_lib
from core.model import Transformer
from core.train import TrainState
from experiments import build, federated, schema

__all__ = ["RunConfigError", "check_workdir", "run_config", "trained_model", "write_records"]

RUN_FILES = ("config.json", "data.json", "checkpoints")
"""What a finished run's workdir holds (experiments.run writes them) and `trained_model` reads."""


PRECISIONS = ("trained", "float")
"""What a loaded model computes its GEMMs in: "trained", the run's `precision.recipe` (a UFP4 run's 4-bit GEMMs, as
it trained and evaluated); "float", ordinary float GEMMs (recipe "none"), what `experiments.hf export` writes and
transformers computes."""


def trained_model(
    workdir: str, *, site: int = 0, precision: str = "trained", step: int | None = None
) -> tuple[ml_collections.ConfigDict, Transformer]:
    """(config, model with the parameters of the checkpoint at `step`, default the latest) of the run in `workdir`;
    for a federated run, site `site`'s model and the config describing it as a model of its own
    (`experiments.federated.site_config`). The model computes its GEMMs as the returned config's `precision.recipe`
    says: the run's own (`precision` = "trained") or "none" (`precision` = "float"; one of PRECISIONS).

    Raises FileNotFoundError naming what is missing (a step the run has no checkpoint of, with the steps it has),
    or ValueError for a site the run does not have or a precision not in PRECISIONS.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision = {precision!r}; allowed: {', '.join(PRECISIONS)}")
    paths = check_workdir(workdir)
    config = run_config(workdir)
    sites = config.mesh.site
    if not 0 <= site < sites:
        raise ValueError(f"site = {site}: the run in {workdir} has mesh.site = {sites} site(s); allowed 0..{sites - 1}")
    with open(paths["data.json"]) as f:
        fingerprint = json.load(f)["fingerprint"]
    checkpointer = checkpoint_lib.Checkpointer(paths["checkpoints"])
    steps = checkpointer.all_steps()
    if not steps:
        raise FileNotFoundError(f"{paths['checkpoints']} holds no checkpoint")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        checkpointer.close()
        raise FileNotFoundError(f"step = {step}: {paths['checkpoints']} holds checkpoints of steps {steps} only")
    compat = schema.checkpoint_compat(config, fingerprint)  # (the run's: before a float model replaces its recipe)
    if precision == "float":
        config.precision.recipe = "none"
    if sites > 1:
        graphdef, _, _, state = federated.initial_state(config)  # [sites, ...] on this process's first device
        state, _ = checkpointer.restore(step, state, compat=compat)
        train = jax.tree.map(lambda x: x[site], state.train)
        config = _on_one_device(federated.site_config(config))  # the site's model as a model of its own
    else:
        config = _on_one_device(config)  # the arrays are restored onto one device, whatever mesh wrote them
        schema.validate(config, num_devices=1, source=False)  # (an imported run loads without its source)
        graphdef, like = _restore_target(config)
        train, _ = checkpointer.restore(step, like, compat=compat)
    checkpointer.close()
    return config, nnx.merge(graphdef, train.params, train.rest)


def _restore_target(config: ml_collections.ConfigDict) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, the training state's shapes, dtypes and shardings on the one device of `config`'s mesh): what
    `core.checkpoint.Checkpointer.restore` restores a single-site run's checkpoint into. Abstract
    (`core.train.state_layout`): the random parameters and optimizer state that `core.train.init_state` would
    compute (and compile a program for) are not, since the checkpoint replaces all of them."""
    _, sharder = build.build_mesh(config)
    graphdef, shapes, shardings = train_lib.state_layout(
        build.build_model_fn(config, sharder), build.build_optimizer(config), config.train.seed, sharder
    )
    return graphdef, jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def write_records(workdir: str, config: ml_collections.ConfigDict, corpus) -> None:
    """Writes the run's config.json (the resolved `config`) and data.json (`corpus`'s description and fingerprint:
    a core.corpus Corpus or CorpusRecord) into `workdir`: what `run_config` and `trained_model` read back. A
    training run writes them once a checkpoint is accepted; an import (experiments.pretrained) before its step 0."""
    workdir_lib.write_json(os.path.join(workdir, "config.json"), config.to_dict())
    workdir_lib.write_json(os.path.join(workdir, "data.json"), {"fingerprint": corpus.fingerprint, **corpus.info})


def check_workdir(workdir: str) -> dict[str, str]:
    """{name: path} of RUN_FILES in `workdir`; raises FileNotFoundError naming those missing (cheap: nothing is
    read, so a caller such as experiments.serve can refuse a workdir before it loads anything)."""
    paths = {name: os.path.join(workdir, name) for name in RUN_FILES}
    missing = [p for p in paths.values() if not os.path.exists(p)]
    if missing and schema.hf_checkpoint_problem(workdir) is None:
        raise FileNotFoundError(
            f"{workdir} is a Hugging Face checkpoint, not a run: import it first "
            f"(`python -m experiments.hf import --hf-dir {workdir} --workdir runs/NAME`), then pass that workdir"
        )
    if missing:
        raise FileNotFoundError(
            f"{workdir} is not a finished run's workdir: missing {missing} (train one with "
            "`python -m experiments.run --config ... --workdir ...`)"
        )
    return paths


def _on_one_device(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` with a mesh of one device in one process (mesh.data = mesh.expert = mesh.model = 1): what the loaded
    model runs on, whatever data, tensor or expert parallelism (or processes) the run trained with. The arrays' global
    shapes do not depend on the mesh, so a checkpoint of any mesh restores into this one. mesh.site is left to the
    caller (a federated run's site_config)."""
    out = config.copy_and_resolve_references()
    out.mesh.update(data=1, expert=1, model=1, num_processes=1, process_id=0, coordinator_address="")
    return out


class RunConfigError(ValueError):
    """A run's config.json that cannot be read back (edited by hand, damaged): the message names the file and the
    key."""


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """The resolved config a run in `workdir` trained with (its config.json over today's defaults: sections and keys
    added since the run was trained keep their defaults). Raises RunConfigError naming the file and the key for a
    file that is no JSON object of sections (a directory, not JSON), an unknown section or key, a value of the wrong
    type or range, or a missing `model` section or key (`_check_model_keys`)."""
    path = os.path.join(workdir, "config.json")
    config = schema.default_config()
    try:
        with open(path) as f:
            saved = json.load(f)
    except ValueError as e:
        raise RunConfigError(f"{path} is not JSON ({e}): a run's config.json is what experiments.run wrote") from None
    except OSError as e:  # a directory in its place, unreadable, ...
        what = "is a directory, not a file" if os.path.isdir(path) else f"cannot be read ({e.strerror or e})"
        raise RunConfigError(f"{path} {what}: a run's config.json is the JSON file experiments.run wrote") from None
    if not isinstance(saved, dict):
        raise RunConfigError(f"{path} holds a JSON {type(saved).__name__}, not an object of config sections")
    for section, values in saved.items():
        if section not in config:
            raise RunConfigError(f"{path}: '{section}' is not a config section; allowed: {', '.join(config)}")
        if not isinstance(values, dict):
            raise RunConfigError(f"{path}: section '{section}' is a JSON {type(values).__name__}, not an object")
        for key, value in values.items():
            if key not in config[section]:
                raise RunConfigError(f"{path}: '{section}.{key}' is not a config key of section '{section}'")
            try:
                config[section][key] = _tuples(value) if isinstance(config[section][key], tuple) else value
            except (TypeError, ValueError) as e:
                raise RunConfigError(f"{path}: '{section}.{key}' = {value!r}: {e}") from None
    try:
        core_schema.validate(config, schema.schema())
    except fields_lib.ConfigError as e:
        raise RunConfigError(f"{path}: {e}") from None
    _check_model_keys(path, saved)
    return config


def _check_model_keys(path: str, saved: dict) -> None:
    """Raises RunConfigError if config.json has no `model` section or lacks one of its keys (those added since
    checkpoints were written, `since_checkpoints`, may be absent): the section says what the checkpoint's weights
    are, and a default in its place would describe another model than the checkpoint's."""
    fields = fields_lib.section_fields(config_lib.TransformerConfig)
    needed = [k for k, f in fields.items() if not f.since_checkpoints]
    if "model" not in saved:
        raise RunConfigError(
            f"{path} has no 'model' section, which says what the checkpoint's weights are ({', '.join(needed[:4])}, "
            "...): a run's config.json is what experiments.run wrote; restore it"
        )
    missing = [k for k in needed if k not in saved["model"]]
    if missing:
        raise RunConfigError(
            f"{path}: section 'model' lacks {', '.join(repr(f'model.{k}') for k in missing[:4])}, which say what the "
            "checkpoint's weights are: a run's config.json is what experiments.run wrote; restore it"
        )


def _tuples(value):
    """JSON lists back to the tuples the config declared (mesh rules are hashed as static jit arguments)."""
    return tuple(map(_tuples, value)) if isinstance(value, list) else value
