"""`python -m experiments.run` as a new user meets it: --help lists every config key with its default (checked against
the schema), and a mistyped config file, override key or value is one `error:` line naming it and what is allowed,
returned before anything is built or compiled. (The end-to-end runs are in test_cli.)"""

import os

import pytest

from experiments import args as args_lib
from experiments import run, schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "experiments", "configs")
QUICKSTART = os.path.join(CONFIGS, "quickstart.py")


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fails the test if the command line gets as far as training (validation, data, mesh, compilation)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the command line reached experiments.run.run")

    monkeypatch.setattr(run, "run", forbidden)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_the_flags_and_every_config_key_with_its_default(capsys, nothing_runs, flag):
    assert run.main(["run", flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m experiments.run --config")
    for needle in ("--config FILE", "--workdir DIR", "--config.<section>.<key>=", "docs/configuration.md"):
        assert needle in out, needle
    flat = " ".join(out.split())  # long defaults (mesh.rules) wrap over lines
    for section, fields in schema.schema().items():
        for key, field in fields.items():
            entry = " ".join(f"{section}.{key} = {field.default!r} [{field.describe()}]".split())
            assert entry in flat, entry
            assert " ".join(field.doc.split()) in flat, (section, key)


def _listed_configs() -> list[str]:
    return sorted(n for n in os.listdir(CONFIGS) if n.endswith(".py") and not n.startswith("_"))


@pytest.mark.parametrize(
    "args, needles",
    [
        # a config file name typo: the flag, the path, the config files there and the closest one
        (
            [f"--config={CONFIGS}/quikstart.py"],
            ["--config=", "quikstart.py", "no such file", *_listed_configs(), "Did you mean", "quickstart.py?"],
        ),
        ([f"--config={CONFIGS}"], ["is a directory", *_listed_configs()]),
        ([f"--config={QUICKSTART}:foo"], ["quickstart.py:foo", "takes no ':arg'"]),
        ([f"--config={CONFIGS}/finetune.py"], ["finetune.py", "hf_dir", "finetune.py:<hf_dir>"]),
        # an unknown key: the key, the closest match and the section's keys
        (
            ["--config.optim.lerning_rate=1"],
            ["--config.optim.lerning_rate=1", "Did you mean optim.learning_rate?", "warmup_steps", "grad_clip_norm"],
        ),
        (["--config.modle.d_model=1"], ["section 'modle'", "model.d_model", "kvcache"]),
        (["--config.optim=3"], ["'optim' is a section", "--config.optim.<key>=<value>", "learning_rate"]),
        # a value of the wrong type: the flag, the value and what the key takes
        (["--config.optim.learning_rate=abc"], ["--config.optim.learning_rate=abc", "'abc'", "float in (0, inf)"]),
        (["--config.train.steps=1.5"], ["--config.train.steps=1.5", "'1.5'", "int in [1, inf)"]),
        (["--config.model.qk_norm=maybe"], ["model.qk_norm", "'maybe'", "bool"]),
        (["--config.train.steps"], ["--config.train.steps needs a value", "int"]),
        (["--config.optim.b1=None"], ["optim.b1", "cannot set None", "leave the flag out"]),
        # flags that are no flags of this program
        (["--steps=10"], ["'steps'", "Did you mean --config.train.steps?"]),
        (["quickstart"], ["unexpected argument 'quickstart'", "--config ", "configs/quickstart.py"]),
    ],
)
def test_bad_command_line_is_one_clear_error_before_anything_runs(capsys, nothing_runs, tmp_path, args, needles):
    config = [] if any(a.startswith("--config=") for a in args) else [f"--config={QUICKSTART}"]
    code = run.main(["run", *config, f"--workdir={tmp_path}", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("error: ") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    for internals in ("Traceback", "config_config", "Attempted", "Error whilst parsing"):
        assert internals not in err, (internals, err)
    assert os.listdir(tmp_path) == []


def test_a_short_run_fits_the_warm_up_and_records_it(capsys):
    """--config.train.steps=10 on a config warming up over 40 steps needs no second flag: the config the run
    trains with (and writes to config.json) warms up over the 10 steps, and the command line says so."""
    config, _ = args_lib.parse_run_args(
        ["run", f"--config={QUICKSTART}", "--workdir=unused", "--config.train.steps=10"]
    )
    assert (config.train.steps, config.optim.warmup_steps) == (10, 10)
    out = capsys.readouterr().out
    assert "optim.warmup_steps = 40 > train.steps = 10: warming up over all 10 steps" in out
    schema.validate(config)
    config, _ = args_lib.parse_run_args(
        ["run", f"--config={QUICKSTART}", "--workdir=unused", "--config.train.steps=50"]
    )
    assert config.optim.warmup_steps == 40 and "warming up" not in capsys.readouterr().out


def test_a_config_returning_a_dict_and_a_fifo_tokenizer_are_named_as_what_they_are(capsys, nothing_runs, tmp_path):
    """get_config() returning a plain dict: one `error:` line (exit 2) saying it must return a ConfigDict (not an
    attribute error); a FIFO as data.tokenizer: "not a regular file" (not "does not exist")."""
    from core import tokenizer as tokenizer_lib
    from core.byte_tokenizer import TokenizerError

    (tmp_path / "dict_config.py").write_text('def get_config():\n    return {"train": {"steps": 3}}\n')
    code = run.main(["run", f"--config={tmp_path}/dict_config.py", f"--workdir={tmp_path}/w"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "get_config() must return an ml_collections.ConfigDict, got dict" in err, err
    os.mkfifo(tmp_path / "tok.json")
    with pytest.raises(TokenizerError, match="tok.json' is not a regular file"):
        tokenizer_lib.load(str(tmp_path / "tok.json"))
