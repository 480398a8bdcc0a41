"""Config validation: every kind of bad input is rejected with a message naming the key, the value and the rule."""

import dataclasses
import pathlib
from typing import Any

import ml_collections
import pytest

from core import config as config_lib
from core import fields as fields_lib
from core import mesh_config
from core import schema as core_schema
from core.fields import ConfigError
from experiments import schema
from moe.config import MoEConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def declared_compat(cls: type) -> fields_lib.Compat | None:
    """A section's `compat` class variable (None if it declares none: SECTIONS holds plain types)."""
    return getattr(cls, "compat", None)


def test_defaults_are_valid_and_every_default_passes_its_field():
    schema.validate(schema.default_config(), num_devices=8)
    for section, fields in schema.schema().items():
        for key, field in fields.items():
            field.check(f"{section}.{key}", field.default)


@pytest.mark.parametrize("name", list(schema.SECTIONS))
def test_each_section_is_declared_once_and_its_dataclass_matches_the_schema(name):
    """The schema, the default ConfigDict and the dataclass code reads are one declaration: same keys in the same
    order, same defaults, each key documented, and `compat` names only keys the section has."""
    cls = schema.SECTIONS[name]
    fields = schema.schema()[name]
    assert list(fields) == [f.name for f in dataclasses.fields(cls)]
    section = schema.default_config()[name]
    assert set(section.keys()) == set(fields)
    assert fields_lib.from_config(cls, section) == cls()
    declared = {f.name: f.default for f in dataclasses.fields(cls)}  # (an instance may resolve a default: head_dim)
    for key, field in fields.items():
        assert field.doc, f"{name}.{key} has no documentation"
        assert declared[key] == field.default
    compat = declared_compat(cls)
    assert compat in (True, False) or (isinstance(compat, tuple) and set(compat) <= set(fields))


def test_checkpoint_compat_follows_the_section_declarations():
    c = schema.default_config()
    facts = schema.checkpoint_compat(c, "fingerprint")
    expected: dict[str, Any] = {"data": "fingerprint"}
    for name, cls in schema.SECTIONS.items():
        compat = declared_compat(cls)
        if compat is True:  # (less the keys added since checkpoints, at their default)
            fields = fields_lib.section_fields(cls)
            expected[name] = {
                k: v
                for k, v in c[name].to_dict().items()
                if not (fields[k].since_checkpoints and v == fields[k].default)
            }
        elif isinstance(compat, tuple):
            expected.update({f"{name}.{key}": c[name][key] for key in compat})
    assert facts == expected
    # what a resumed run may change (runtime choices) and what it may not (the architecture, the optimizer)
    assert {"model", "moe", "fomoe", "precision", "optim.name", "data.seq_len", "data.batch_size"} <= set(facts)
    assert not {"kvcache", "train", "mesh", "checkpoint", "sample", "optim.learning_rate"} & set(facts)


def test_a_key_added_since_checkpoints_leaves_their_compat_unchanged_at_its_default():
    """moe.shared_expert_gate (since_checkpoints): absent from the compat facts at its default (False), so a
    checkpoint written before the key existed, whose record lacks it, still resumes; set, it is a fact, so such a
    checkpoint is refused for the model that differs."""
    c = schema.default_config()
    assert "shared_expert_gate" not in schema.checkpoint_compat(c, "f")["moe"]
    c.moe.shared_expert_gate = True
    assert schema.checkpoint_compat(c, "f")["moe"]["shared_expert_gate"] is True
    fields = fields_lib.section_fields(MoEConfig)
    assert [k for k, f in fields.items() if f.since_checkpoints] == [
        "shared_expert_gate",
        "ep_exchange",
        "ep_capacity_factor",
    ]


def test_from_config_rejects_unknown_keys_and_restores_tuples():
    mesh = schema.default_config().mesh.to_dict()
    mesh["rules"] = [list(rule) for rule in mesh["rules"]]  # as JSON or the command line gives them back
    assert fields_lib.from_config(config_lib.MeshConfig, mesh) == config_lib.MeshConfig()
    with pytest.raises(ConfigError, match="dmodel"):
        fields_lib.from_config(config_lib.TransformerConfig, {"dmodel": 3})


def test_a_none_default_can_be_set_from_the_command_line():
    """Keys whose default is None (the optimizer family's default) hold typed placeholders."""
    spec = {"s": {"x": fields_lib.Field(None, (float, type(None)), "doc", low=0.0)}}
    c = core_schema.defaults(spec)
    assert c.s.x is None
    c.s.x = 0.5
    spec["s"]["x"].check("s.x", c.s.x)
    with pytest.raises(ConfigError, match="s.x"):
        spec["s"]["x"].check("s.x", -1.0)
    assert spec["s"]["x"].describe() == "float in [0, inf) or None"


def _error(changes, num_devices=8):
    """Applies {"section.key": value} to a default config built as a plain dict (as a config file may return)."""
    d = schema.default_config().to_dict()
    for key, value in changes.items():
        section, _, name = key.partition(".")
        if value is DELETE:
            del d[section][name]
        elif name:
            d.setdefault(section, {})[name] = value
        else:
            d[section] = value
    with pytest.raises(ConfigError) as e:
        schema.validate(ml_collections.ConfigDict(d), num_devices=num_devices)
    return str(e.value)


DELETE = object()


@pytest.mark.parametrize(
    "changes, needles",
    [
        ({"model.dmodel": 3}, ["model.dmodel", "model.d_model"]),
        ({"modle": {"x": 1}}, ["modle", "model"]),
        ({"model": 3}, ["model", "section"]),
        ({"train.steps": "300"}, ["train.steps", "'300'", "int"]),
        ({"train.steps": 3.0}, ["train.steps", "3.0", "int"]),
        ({"optim.learning_rate": True}, ["optim.learning_rate", "True", "float"]),
        ({"model.norm": "batchnorm"}, ["model.norm", "'batchnorm'", "rmsnorm", "layernorm"]),
        ({"optim.b2": 1.5}, ["optim.b2", "1.5", "[0, 1]"]),
        ({"data.val_fraction": 0.0}, ["data.val_fraction", "0.0", "(0, 0.5]"]),
        ({"optim.learning_rate": float("nan")}, ["optim.learning_rate", "nan", "finite"]),
        ({"optim.learning_rate": 1e39}, ["optim.learning_rate", "1e+39", "float32", "3.4e+38"]),  # inf in float32
        ({"model.num_heads": 5}, ["model.num_heads", "5", "model.d_model", "256"]),
        ({"model.num_kv_heads": 3}, ["model.num_kv_heads", "3", "model.num_heads"]),
        ({"model.d_model": 24, "model.num_heads": 8}, ["head dim", "3", "even"]),
        ({"model.vocab_size": 100}, ["model.vocab_size", "100", "259"]),
        ({"optim.warmup_steps": 5000}, ["optim.warmup_steps", "5000", "train.steps"]),
        ({"mesh.data": 4, "mesh.model": 4}, ["16 devices", "8"]),
        ({"mesh.data": -1, "mesh.model": -1}, ["mesh.data", "mesh.model", "-1"]),
        ({"mesh.data": -1, "mesh.model": 3}, ["mesh.data", "3", "8 devices"]),
        ({"mesh.model": 0}, ["mesh.model", "0"]),
        ({"mesh.data": 8, "data.batch_size": 12}, ["data.batch_size", "12", "8"]),
        ({"mesh.data": 1, "mesh.model": 8, "model.num_kv_heads": 4}, ["model.num_kv_heads", "4", "mesh.model", "8"]),
        (  # every key the model axis cannot split, in one message
            {"mesh.data": 2, "mesh.model": 4, "model.num_heads": 2, "model.num_kv_heads": 1},
            ["'model.num_heads' = 2 and 'model.num_kv_heads' = 1", "'model' = 4"],
        ),
        ({"mesh.site": 2, "mesh.data": 2, "mesh.model": 4}, ["16 devices", "mesh.site = 2", "--config.mesh.site=1"]),
        ({"mesh.rules": (("batch", "dta"),)}, ["mesh.rules", "'dta'", "site"]),
        ({"mesh.rules": (("batch", "data"), ("batch", None))}, ["mesh.rules", "batch"]),
        ({"mesh.rules": ("batch",)}, ["mesh.rules", "'batch'"]),
        ({"mesh.process_id": 2}, ["mesh.process_id", "2", "mesh.num_processes"]),
        ({"mesh.num_processes": 2}, ["mesh.coordinator_address", "host:port"]),
        ({"optim.name": "sgd"}, ["optim.name", "'sgd'", "adamw"]),
        ({"model.d_ff": DELETE}, ["model.d_ff", "missing"]),
        # optimizer hyper-parameters that pass each key's own range but train nothing or diverge silently
        ({"optim.b2": 0.0}, ["'optim.b2' = 0.0", "second-moment decay", "allowed: (0, 1)"]),
        ({"optim.b2": 0.5}, ["'optim.b1' = 0.9", "'optim.b2' = 0.5", "b1^2 = 0.81", "b2 > b1^2"]),
        ({"optim.b1": 1.0}, ["'optim.b1' = 1.0", "allowed: [0, 1)"]),
        ({"optim.eps": 0.0}, ["'optim.eps' = 0.0", "allowed: (0, inf)"]),
        ({"optim.name": "lion", "optim.b2": 1.0}, ["'optim.b2' = 1.0", "Lion", "allowed: [0, 1)"]),
        ({"optim.name": "muon", "optim.momentum": 1.0}, ["'optim.momentum' = 1.0", "allowed: [0, 1)"]),
        ({"optim.name": "mgup_muon", "optim.b2": 0.9}, ["'optim.b1' = 0.95", "'optim.b2' = 0.9", "b1^2 < b2"]),
        ({"optim.learning_rate": 0.0}, ["optim.learning_rate", "0.0", "(0, inf)"]),
        (
            {"optim.learning_rate": 2.0, "optim.weight_decay": 0.5},
            ["learning_rate", "weight_decay", "x weight_decay < 1"],
        ),
        # sizes past what an array can hold: refused by name, not an abort inside XLA
        ({"model.d_model": 10**30}, ["'model.d_model' = " + str(10**30), "64-bit", "[1, 1,048,576]"]),
        ({"model.d_ff": 2**30}, ["'model.d_ff' = 1073741824", "[1, 1,048,576]"]),
        ({"moe.expert_size": 2**30}, ["'moe.expert_size' = 1073741824", "[1, 1,048,576]"]),
    ],
)
def test_bad_config_is_rejected_with_a_clear_message(changes, needles):
    message = _error(changes)
    for needle in needles:
        assert needle in message, (needle, message)


def test_static_validation_needs_no_devices():
    c = schema.default_config()
    c.mesh.data, c.mesh.model = 4, 4  # 16 devices: fine until we know how many there are
    schema.validate(c)
    with pytest.raises(ConfigError):
        schema.validate(c, num_devices=8)


def test_mesh_shape_resolves_the_free_axis():
    c = schema.default_config()
    c.mesh.model = 2
    assert mesh_config.mesh_shape(c, 8) == {"site": 1, "data": 4, "expert": 1, "model": 2}


def test_int_is_accepted_for_float_but_not_bool_for_int():
    d = schema.default_config().to_dict()
    d["optim"]["learning_rate"] = 1  # a config file may write an int where a float is expected
    schema.validate(ml_collections.ConfigDict(d))
    field = schema.schema()["train"]["steps"]
    with pytest.raises(ConfigError, match="bool"):
        field.check("train.steps", True)


def test_configuration_reference_is_current():
    """docs/configuration.md is generated from the schema: regenerate with `python -m experiments.config_doc`."""
    from experiments import config_doc

    assert (ROOT / "docs" / "configuration.md").read_text() == config_doc.render()


@pytest.mark.parametrize(
    "steps, warmup, fitted", [(10, 40, 10), (1, 40, 1), (40, 40, 40), (50, 40, 40), (10, 0, 0), ("10", 40, 40)]
)
def test_fit_to_steps_lowers_only_a_warm_up_longer_than_the_run(steps, warmup, fitted):
    """A warm-up longer than the run becomes the run's length, with a notice naming both keys; anything else is left
    as it is (a mistyped value for validate to report)."""
    d = schema.default_config().to_dict()  # a plain dict, as a config file may return (a typed ConfigDict refuses "10")
    d["train"]["steps"], d["optim"]["warmup_steps"] = steps, warmup
    c = ml_collections.ConfigDict(d)
    notices = core_schema.fit_to_steps(c)
    assert c.optim.warmup_steps == fitted
    d["optim"]["warmup_steps"] = fitted
    assert c.to_dict() == d  # no other key changes
    if fitted == warmup:
        assert notices == []
    else:
        assert notices == [f"optim.warmup_steps = {warmup} > train.steps = {steps}: warming up over all {steps} steps"]


def test_a_fitted_warm_up_ramps_linearly_over_the_whole_run():
    """The schedule of a fitted run (warmup = steps = 10) is the linear ramp peak * t / 10 at every step it trains."""
    from core import train as train_lib

    c = schema.default_config()
    c.train.steps, c.optim.warmup_steps = 10, 40
    core_schema.fit_to_steps(c)
    schema.validate(c)
    schedule = train_lib.learning_rate_schedule(c.optim, c.train.steps)
    peak = c.optim.learning_rate
    for t in range(10):
        assert float(schedule(t)) == pytest.approx(peak * t / 10, rel=1e-6, abs=1e-12)
