"""The command-line head of every benchmark and reproduction script (experiments.harness.parser, its flag
types and `command`): --help renders in-process, says what the script does in full sentences, documents every flag
with its default, writes under runs/ unless told `--out results/...`; bad values are refused naming the flag, the
value and the rule; the command line a table states gives back the same arguments."""

import argparse
import importlib
import json
import pathlib

import pytest

from experiments import harness

MODULES = [
    *(
        f"experiments.bench.{m}"
        for m in (
            "cpu_step",
            "decode",
            "engine_step",
            "link_rate",
            "moe",
            "optim",
            "overlap",
            "peer",
            "quant",
            "serve_http",
            "skip_token",
            "train_step",
        )
    ),
    *(
        f"experiments.reproduce.{m}"
        for m in (
            "composed",
            "fomoe",
            "fomoe_elastic",
            "fomoe_peers",
            "fomoe_sync",
            "fomoe_system",
            "hf",
            "kvcache",
            "links",
            "links_churn",
            "links_decoupled",
            "links_elastic",
            "mgup",
            "serving",
            "ufp4",
            "ufp4_scale",
        )
    ),
]


def _words(text: str) -> str:
    return " ".join(text.split())


def _help(module, monkeypatch, capsys) -> tuple[argparse.ArgumentParser, str]:
    """The parser `module.main` builds and its --help text."""
    made = []
    real = harness.parser

    def recording_parser(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(harness, "parser", recording_parser)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    return made[0], capsys.readouterr().out


@pytest.mark.parametrize("name", MODULES)
def test_help_states_the_whole_first_paragraph_and_every_flag_with_its_default(name, monkeypatch, capsys):
    module = importlib.import_module(name)
    parser, text = _help(module, monkeypatch, capsys)
    assert module.__doc__ is not None  # the script's docstring is its --help description
    first = module.__doc__.strip().split("\n\n")[0]
    assert _words(first) in _words(text)  # the whole paragraph, not its first line cut mid-sentence
    assert (parser.description or "").endswith(".") and text.startswith(f"usage: python -m {name} ")
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    out = next(a for a in flags if "--out" in a.option_strings)
    topic = out.default.removeprefix("runs/")
    # never results/ unasked; the help says how to update the committed tables
    assert out.default == f"runs/{topic}" and f"--out results/{topic}" in _words(out.help or "")
    for action in flags:
        assert action.help and len(action.help) > 10, f"{name} {action.option_strings}: no help text"
        if action.default not in ("", None, False):
            shown = "".join(text.split())  # argparse may break a long default (a list of names) anywhere
            assert f"(default:{action.default})".replace(" ", "") in shown, (
                f"{name} {action.option_strings}: no default"
            )


@pytest.mark.parametrize(
    "name, argv, words",
    [
        ("experiments.reproduce.fomoe", ["--steps", "48"], ["--steps", "'48'", "multiple of 32"]),
        ("experiments.reproduce.ufp4", ["--steps", "425"], ["--steps", "'425'", "multiple of 50"]),
        ("experiments.reproduce.mgup", ["--only", "adamw,sgd"], ["--only", "'sgd'", "allowed"]),
        ("experiments.bench.moe", ["--tokens", "300"], ["--tokens", "'300'", "multiple of 256"]),
        ("experiments.bench.decode", ["--contexts", "1024,0"], ["--contexts", "'1024,0'", ">= 1"]),
        ("experiments.reproduce.serving", ["--formats", "fp16"], ["--formats", "'fp16'", "bf16"]),
        ("experiments.bench.skip_token", ["--ghosts", "4,8"], ["--ghosts", "first 0"]),
    ],
)
def test_a_bad_value_is_refused_naming_flag_value_and_rule(name, argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(name).main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


@pytest.mark.parametrize("minimum, multiple", [(1, 1), (32, 32), (10, 10), (0, 3)])
def test_integer_accepts_exactly_the_multiples_at_or_above_the_minimum(minimum, multiple):
    parse = harness.integer(minimum, multiple_of=multiple)
    for n in range(-5, 100):
        if n >= minimum and n % multiple == 0:
            assert parse(str(n)) == n
        else:
            with pytest.raises(argparse.ArgumentTypeError, match=repr(str(n))):
                parse(str(n))
    for bad in ("", "1.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_integer_and_name_lists():
    seeds = harness.integers(0, distinct=True)
    assert seeds("3,0,11") == [3, 0, 11]
    for bad in ("", "0,0", "-1", "1,a"):
        with pytest.raises(argparse.ArgumentTypeError):
            seeds(bad)
    assert harness.integers(1, empty=True)("") == [] and harness.integers(1)("7,7") == [7, 7]
    parts = harness.names(["grid", "train"])
    assert parts("train,grid") == ["train", "grid"]
    with pytest.raises(argparse.ArgumentTypeError, match="allowed"):
        parts("grid,tran")
    with pytest.raises(argparse.ArgumentTypeError):
        parts("")
    assert harness.names(["a"], empty=True)("") == []


def test_first_paragraph_joins_the_lines_up_to_the_blank_line():
    doc = "One sentence that\n    runs over two lines.\n\n    python -m x\n\nMore."
    assert harness.first_paragraph(doc) == "One sentence that runs over two lines."


@pytest.mark.parametrize(
    "name, argv",
    [
        ("experiments.reproduce.fomoe", ["--out", "results/fomoe", "--steps", "64", "--only", "ddp_M2,ddp_M4"]),
        ("experiments.reproduce.serving", ["--project", "--out", "results/serving"]),
        ("experiments.bench.decode", ["--contexts", "1024,4096", "--out", "results/bench"]),
        ("experiments.reproduce.composed", []),
    ],
)
def test_the_command_a_table_states_parses_back_to_the_same_arguments(name, argv, monkeypatch, capsys):
    """`harness.command` writes --out always and every other flag only off its default (--steps and --seeds
    always); parsing its words again gives the same namespace."""
    parser, _ = _help(importlib.import_module(name), monkeypatch, capsys)
    args = parser.parse_args(argv)
    line = harness.command(parser, args)
    assert line.startswith(f"python -m {name} --out ")
    assert parser.parse_args(line.split()[3:]) == args


def test_a_study_writes_one_record_into_its_json_its_table_and_its_plots(tmp_path, capsys):
    """`Study.write`: the JSON holds the command (which parses back to the arguments), this machine's CPU model as
    /proc/cpuinfo names it, and the load averages at the start and at the end; the table is the script's markdown
    with a last line naming the same; every plot is called with the same record."""
    study = harness.Study("A study of nothing.\n\nMore.", module="experiments.fake", topic="fake")
    harness.add_steps(study.parser, default=20, multiple_of=10, why="whole rounds")
    harness.add_seeds(study.parser, default="0,1", what="data order")
    args = study.parse(["--out", str(tmp_path / "out"), "--steps", "30"])
    seen = []
    record = study.write(
        "table",
        {"loss": 1.5},
        lambda r: f"# Nothing\n\n`{r['command']}`: loss {r['loss']}\n",
        {"curve.png": lambda r, path: seen.append((r, path))},
    )
    on_disk = json.loads((tmp_path / "out" / "table.json").read_text())
    assert on_disk == record and record["loss"] == 1.5 and seen == [(record, str(tmp_path / "out" / "curve.png"))]
    words = record["command"].split()
    assert words[:3] == ["python", "-m", "experiments.fake"] and study.parser.parse_args(words[3:]) == args
    cpuinfo = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    assert record["machine"]["cpu_model"] == names[0]
    load = record["load_average"]
    assert len(load["before"]) == len(load["after"]) == 3 and min(load["before"] + load["after"]) >= 0
    table = (tmp_path / "out" / "table.md").read_text().splitlines()
    assert table[2] == f"`{record['command']}`: loss 1.5"
    assert names[0] in table[-1] and f"{load['before'][0]:.2f} at the start" in table[-1]
