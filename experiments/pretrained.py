"""A Hugging Face checkpoint as our model, or as a run's workdir (so everything that takes a workdir takes it).

    config, model = pretrained.model_from_hf("path/to/checkpoint")   # a model to call, on the default device
    summary = pretrained.import_to("runs/qwen3", "path/to/checkpoint")
    # then: python -m experiments.serve --workdir runs/qwen3 ...; python -m experiments.hf export --workdir ...

The composition over experiments.hf's mapping: the config is our defaults with the sections the checkpoint's
config.json maps to (experiments.hf.load.apply_to), the model is built by experiments.build and receives the
checkpoint's weights (experiments.hf.load.pretrained_model).

The workdir receives what a run of zero steps would leave: config.json (our defaults with `checkpoint.init_from`
and the architecture and tokenizer it implies), data.json (the corpus the held-out numbers are measured on),
checkpoints/0 (the parameters, created directly in their shardings on the default mesh, and a fresh optimizer state)
and summary.json (the held-out loss and bits per byte of the imported model). To fine-tune, train a new workdir from
the same directory (`--config.checkpoint.init_from=hf:DIR`, experiments/configs/finetune.py).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import ml_collections

from core import checkpoint as checkpoint_lib
from core import corpus as corpus_lib
from core import train as train_lib
from core import workdir as workdir_lib
from core.mesh import Sharder
from core.model import Transformer
from experiments import build, report, schema
from experiments import load as run_load
from experiments.hf import load

__all__ = ["config_from_hf", "import_to", "model_from_hf"]


def config_from_hf(directory: str) -> ml_collections.ConfigDict:
    """Our default config with the sections `directory/config.json` maps to, validated. Raises HFConfigError or
    ConfigError naming the field."""
    config = schema.default_config()
    config.checkpoint.init_from = schema.HF_PREFIX + directory
    load.apply_to(config)
    schema.validate(config)
    return config


def model_from_hf(
    directory: str, *, config: ml_collections.ConfigDict | None = None
) -> tuple[ml_collections.ConfigDict, Transformer]:
    """(config, Transformer with the checkpoint's weights) of the Hugging Face checkpoint in `directory`, on the
    default device. `config`: a resolved config whose other sections (precision, moe.grouped_matmul, ...) the model
    is built with (default: `config_from_hf(directory)`)."""
    config = config_from_hf(directory) if config is None else config
    return config, load.pretrained_model(config, build.build_model_fn(config, Sharder()))


def _unfinished_import(workdir: str) -> bool:
    """Whether `workdir` holds what a killed import leaves: no summary.json, and checkpoints/ holding only step 0
    or orbax's temporary folders (training never saves step 0, so no run's checkpoints are mistaken for it)."""
    if os.path.exists(os.path.join(workdir, "summary.json")):
        return False
    entries = os.listdir(os.path.join(workdir, "checkpoints"))
    return all(e == "0" or e.startswith("0.orbax-checkpoint-tmp") for e in entries)


def import_to(
    workdir: str, directory: str, *, config: ml_collections.ConfigDict | None = None, eval_batches: int = 8
) -> dict[str, Any]:
    """Writes the Hugging Face checkpoint in `directory` into `workdir` as a run at step 0 (module docstring) and
    returns its summary (held-out `val_loss`, `val_bits_per_byte`, `num_params`).

    Args:
      config: a config to start from (its data section chooses the held-out corpus; default: the defaults); its
        `checkpoint.init_from` is set to `directory`.
      eval_batches: held-out batches the summary is measured on, of `config.data.batch_size` sequences (0: none:
        no evaluation is compiled and the corpus is not tokenized, only fingerprinted).
    Raises:
      HFConfigError, HFWeightsError or ConfigError naming the field or tensor, before anything is written;
      WorkdirError if `workdir` already holds a run's checkpoints or is in use (what a killed import left, no
        summary.json and only step 0, is started over, saying so).
    """
    config = schema.default_config() if config is None else config
    config.checkpoint.init_from = schema.HF_PREFIX + directory
    config.train.eval_batches = max(eval_batches, 1)
    schema.validate(config)
    load.resolve(config)  # the architecture, the tokenizer, and the checkpoint's headers checked
    schema.validate(config, num_devices=jax.device_count())
    ckpt_dir = os.path.join(workdir, "checkpoints")
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        if not _unfinished_import(workdir):
            raise workdir_lib.WorkdirError(
                f"{workdir} already holds a run's checkpoints; import into a new --workdir (nothing was changed)"
            )
        print(
            f"note: {workdir} holds an import that was stopped before it finished (no summary.json): starting it over",
            flush=True,
        )
        shutil.rmtree(ckpt_dir)
    corpus: corpus_lib.Corpus | corpus_lib.CorpusRecord  # run_load.write_records records its fingerprint and info
    if eval_batches:
        corpus, batches = build.build_data(config)
        batches.val_batches(eval_batches)  # a held-out split too short for them is refused here, not half-way
    else:  # nothing is evaluated: the corpus is only recorded (its fingerprint), never tokenized
        corpus = build.describe_data(config)
    _, sharder = build.build_mesh(config)
    model_fn = build.build_model_fn(config, sharder)
    optimizer = build.build_optimizer(config)
    with workdir_lib.lock(workdir):
        graphdef, state = train_lib.init_state(
            model_fn, optimizer, config.train.seed, sharder, init_params=load.init_params(config)
        )
        summary: dict[str, Any] = {"imported_from": os.path.abspath(directory), "steps": 0}
        if eval_batches:
            stepper = train_lib.PlainStepper(graphdef, optimizer, batches, sharder, eval_batches=eval_batches)
            summary.update(stepper.evaluate(state))
        summary["num_params"] = report.count_params(model_fn)
        run_load.write_records(workdir, config, corpus)
        checkpointer = checkpoint_lib.Checkpointer(ckpt_dir)
        checkpointer.save(
            0,
            state,
            loop={},
            compat=schema.checkpoint_compat(config, corpus.fingerprint),
            provenance=schema.provenance(config),
        )
        checkpointer.close()
        workdir_lib.write_json(os.path.join(workdir, "summary.json"), summary)
    return summary
