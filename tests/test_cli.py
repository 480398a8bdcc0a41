"""The CLI: clear rejection of bad flags, end-to-end runs, crash and resume, multi-process runs.

Resume after a crash is checked in-process with a hook that raises at a chosen step (deterministic); one test sends
a real SIGKILL, to a site's process of a multi-process run, and relaunches it. Reference runs train in this process
(on as many of its virtual devices as their mesh uses); the runs spread over processes are separate processes.
"""

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments import args as args_lib
from experiments import run, serve
from experiments.cluster import links

from helpers import metric_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "configs", "quickstart.py")
COMPOSED = os.path.join(ROOT, "experiments", "configs", "composed.py")
TINY = [
    "--config.model.d_model=32",
    "--config.model.num_layers=1",
    "--config.model.num_heads=4",
    "--config.model.num_kv_heads=2",
    "--config.model.d_ff=64",
    "--config.data.seq_len=16",
    "--config.data.batch_size=8",
    "--config.optim.warmup_steps=2",
    "--config.train.log_every=2",
    "--config.train.eval_batches=2",
    "--config.train.progress=False",
    "--config.sample.num_tokens=8",
    "--config.mesh.site=1",
    "--config.mesh.data=-1",
]


def _main(capsys, *args):
    code = run.main(["run", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--config.model.dmodel=3"], ["model.dmodel", "model.d_model"]),
        (["--config.train.steps=abc"], ["--config.train.steps=abc", "int"]),
        (["--config.train.steps=2.5"], ["--config.train.steps=2.5"]),
        (["--config.model.norm=batchnorm"], ["model.norm", "'batchnorm'", "rmsnorm"]),
        (["--config.model.num_heads=7"], ["model.num_heads", "7", "model.d_model"]),
        (["--config.mesh.model=64"], ["64", "devices"]),
        (["--bogus=1"], ["bogus"]),
    ],
)
def test_bad_flags_are_rejected_clearly(capsys, tmp_path, args, needles):
    code, err = _main(capsys, f"--config={CONFIG}", f"--workdir={tmp_path}", *args)
    assert code == 2
    assert err.startswith("error: ")
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "checkpoints").exists()


def test_missing_required_flags(capsys, tmp_path):
    code, err = _main(capsys, f"--workdir={tmp_path}")
    assert code == 2 and "--config is required" in err
    code, err = _main(capsys, f"--config={CONFIG}")
    assert code == 2 and "--workdir is required" in err
    code, err = _main(capsys, f"--config={tmp_path}/nope.py", f"--workdir={tmp_path}")
    assert code == 2 and "nope.py" in err


def test_a_refused_run_creates_nothing_and_leaves_an_earlier_lock_record_as_it_was(capsys, tmp_path):
    """Bad data (a missing path, a FIFO, /dev/zero, an empty folder, a glob matching nothing, an empty jsonl_field,
    a sequence longer than the corpus) and a batch the mesh cannot divide: exit 2 with an `error:` line naming the
    key; a new workdir is not created, and an existing one keeps its lock record (and nothing else appears in it)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "data.jsonl").write_text('{"text": "some text"}\n')
    os.mkfifo(tmp_path / "fifo")
    cases = [
        ([f"--config.data.path={tmp_path}/none"], "data.path"),
        ([f"--config.data.path={tmp_path}/fifo"], "data.path"),
        (["--config.data.path=/dev/zero"], "data.path"),
        ([f"--config.data.path={tmp_path}/empty"], "data.path"),
        ([f"--config.data.path={tmp_path}/*.none"], "data.path"),
        ([f"--config.data.path={tmp_path}/data.jsonl", "--config.data.jsonl_field="], "data.jsonl_field"),
        (["--config.data.seq_len=100000000"], "data.seq_len"),
        (["--config.data.batch_size=7"], "batch_size"),
    ]
    old = tmp_path / "old"
    old.mkdir()
    (old / ".lock").write_text('{"pid": 1, "host": "elsewhere", "started": "2026-01-01"}\n')
    for args, key in cases:
        for workdir in (tmp_path / "new", old):
            code, err = _main(capsys, f"--config={CONFIG}", f"--workdir={workdir}", *TINY, *args)
            assert code == 2 and err.startswith("error: ") and key in err, (args, err)
        assert not (tmp_path / "new").exists(), args
        assert [p.name for p in old.iterdir()] == [".lock"], args
        assert (old / ".lock").read_text() == '{"pid": 1, "host": "elsewhere", "started": "2026-01-01"}\n'


@pytest.mark.parametrize("damage", ["a directory", "no model section", "d_model 10^30"])
def test_a_run_config_json_that_cannot_be_read_back_is_one_line_naming_it(tmp_path, capsys, damage):
    """A workdir whose config.json is a directory, lacks the `model` section, or gives d_model = 10^30: serve,
    serve --http and hf export exit 2 with one `error:` line naming config.json and what is wrong (not a traceback, not
    a checkpoint mismatch, not a KV pool too small), before any model is loaded; a run resumed there (config.json a
    directory) is refused the same way before it trains."""
    from experiments import schema
    from experiments.hf import __main__ as hf_cli

    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / "data.json").write_text('{"fingerprint": "x"}')
    saved = schema.default_config().to_dict()
    if damage == "a directory":
        (workdir / "config.json").mkdir()
        needles = ["config.json is a directory"]
    elif damage == "no model section":
        del saved["model"]
        needles = ["config.json has no 'model' section"]
    else:
        saved["model"]["d_model"] = 10**30
        needles = ["config.json", "'model.d_model' = " + str(10**30), "[1, 1,048,576]"]
    if damage != "a directory":
        (workdir / "config.json").write_text(json.dumps(saved))
    commands = [
        lambda: serve.main([f"--workdir={workdir}", "--prompt=x"]),
        lambda: serve.main(["--http", f"--workdir={workdir}", "--port=0"]),
        lambda: hf_cli.main(["export", f"--workdir={workdir}", f"--out={tmp_path / 'hf'}"]),
    ]
    if damage == "a directory":
        commands.append(lambda: run.main(["run", f"--config={CONFIG}", f"--workdir={workdir}", *TINY]))
    for command in commands:
        assert command() == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert all(needle in err[0] for needle in needles), (needles, err)
    assert not (tmp_path / "hf").exists() and sorted(p.name for p in workdir.iterdir()) == [
        "checkpoints",
        "config.json",
        "data.json",
    ]


class Crash(Exception):
    """Raised by a step hook: stops a run as a crash would, right after the step (and its checkpoint)."""


def _crash_at(step):
    def hook(done, metrics):
        del metrics
        if done == step:
            raise Crash(step)

    return hook


def _run(workdir, *extra, config=CONFIG, hooks=()):
    """experiments.run in this process (its 8 virtual devices): parse the command line, train, summarise."""
    cfg, wd = args_lib.parse_run_args(["run", f"--config={config}", f"--workdir={workdir}", *TINY, *extra])
    assert run.run(cfg, wd, hooks=hooks) == 0
    return json.loads((workdir / "summary.json").read_text())


@contextlib.contextmanager
def _cache_programs_over(seconds):
    """Within it, this process writes every program that takes `seconds` or more to compile to the session's
    compilation cache (conftest; JAX's default: a second), for runs that compile again what an earlier run of the
    same config compiled (a rerun builds its jitted functions anew). A cached program is the one XLA would compile."""
    import jax

    before = jax.config.values["jax_persistent_cache_min_compile_time_secs"]
    jax.config.update("jax_persistent_cache_min_compile_time_secs", seconds)
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def test_a_finished_run_leaves_its_outputs_loads_serves_and_refuses_another_model(tmp_path, capsys):
    """A finished run's summary, loss curve and sample; the loaded model reproduces its held-out loss and serving it
    streams the greedy continuation; the same workdir with another model is refused with exit code 1 and no file in
    it changes, and serve refuses a damaged checkpoint. (Resume: test_train's crash hook and, with a real SIGKILL,
    the lost-site test below.)"""
    args = [
        "--config.train.steps=8",
        "--config.train.eval_every=4",
        "--config.checkpoint.every=4",
        "--config.mesh.data=1",
        "--config.moe.router=softmax",  # Mixtral's experts, so that the run exports as a Hugging Face checkpoint
        "--config.moe.normalize_gates=True",
        "--config.moe.expert_mlp=swiglu",
    ]
    workdir = tmp_path / "run"
    summary = _run(workdir, *args)
    assert "warning: 7 of the 8 devices idle" in capsys.readouterr().err  # mesh.data = 1 of this process's 8
    for key in ("train_loss", "val_loss", "val_bits_per_byte", "tokens_per_second", "num_params", "steps"):
        assert key in summary, key
    assert summary["steps"] == 8 and summary["num_params"] > 0
    assert (workdir / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (workdir / "sample.txt").read_text().startswith("def ")
    _loaded_model_reproduces_the_held_out_loss(workdir, summary["val_loss"])
    _serve_streams_the_greedy_continuation(workdir, capsys)
    _sigterm_while_the_server_loads_exits_0(workdir)
    _exports_as_a_hugging_face_checkpoint(workdir, tmp_path / "hf", capsys)

    before = _files(workdir)
    code, err = _main(capsys, f"--config={CONFIG}", f"--workdir={workdir}", *TINY, *args, "--config.model.d_model=64")
    assert code == 1 and "d_model: checkpoint 32, now 64" in err and "new --workdir" in err, err
    assert _files(workdir) == before
    # fewer steps than the other model's checkpoint: still named as another model, not as train.steps to raise
    fewer = [*args, "--config.model.d_model=64", "--config.train.steps=4", "--config.train.eval_every=2"]
    code, err = _main(capsys, f"--config={CONFIG}", f"--workdir={workdir}", *TINY, *fewer)
    assert code == 1 and "d_model: checkpoint 32, now 64" in err and "train.steps" not in err, err
    assert _files(workdir) == before

    # 16 damaged bytes in the latest checkpoint's largest file: serve refuses it and nothing changes (a training
    # rerun refuses it the same way: test_workdir's damaged-checkpoint test; the exit code 1 above)
    biggest = max((p for p in (workdir / "checkpoints" / "8").rglob("*") if p.is_file()), key=os.path.getsize)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 16])
    biggest.write_bytes(bytes(data))
    before = _files(workdir)
    assert serve.main([f"--workdir={workdir}", "--prompt=x"]) == 1
    assert "error: " in capsys.readouterr().err
    assert _files(workdir) == before


def test_a_truncated_checkpoint_is_one_line_and_fallback_resumes_without_a_traceback(tmp_path, capsys, monkeypatch):
    """The latest checkpoint's array files cut short: the rerun is refused with exit 1 and one `error:` line naming
    the array TensorStore could not read (no TensorStore spec); with checkpoint.fallback it resumes from the one
    before and finishes (exit 0) printing no traceback: no "Event loop is closed" from the failed restore's other
    reads (core.orbax_compat), on stderr or as an unraisable exception."""
    import sys

    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    workdir = tmp_path / "run"
    args = ["--config.train.steps=4", "--config.train.eval_every=4", "--config.checkpoint.every=2"]
    _run(workdir, *args)
    capsys.readouterr()
    for data in (p for p in (workdir / "checkpoints" / "4" / "state").rglob("*") if p.is_file() and "/d/" in str(p)):
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 3)
    code, err = _main(capsys, f"--config={CONFIG}", f"--workdir={workdir}", *TINY, *args)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "checkpoint of step 4" in lines[0] and "fallback=True" in lines[0], err
    assert "TensorStore" not in err and "spec" not in err, err
    code = run.main(
        ["run", f"--config={CONFIG}", f"--workdir={workdir}", *TINY, *args, "--config.checkpoint.fallback=True"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "checkpoint.fallback: " in out and "resuming from the checkpoint of step 2" in out, out
    assert "Traceback" not in out + err and "Event loop is closed" not in out + err, err[-3000:]
    assert "TensorStore" not in out, out
    assert not unraisable, unraisable[:3]
    assert json.loads((workdir / "summary.json").read_text())["steps"] == 4


def _sigterm_while_the_server_loads_exits_0(workdir):
    """`serve --http` sent SIGTERM once it has checked its flags, while the model loads and compiles (before it
    listens): exit 0, as docs/serving.md says of a SIGTERM, with a line saying it stopped before serving."""
    command = [sys.executable, "-m", "experiments.serve", "--http", f"--workdir={workdir}", "--port=0"]
    server = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        said: list[str] = []
        while not said or not said[-1].startswith("GEMMs:"):  # the last line before the model loads
            said.append(server.stderr.readline())
            assert said[-1], said
        server.send_signal(signal.SIGTERM)
        rest = server.stderr.read()
        assert server.wait(timeout=120) == 0, rest
        assert "stopped before serving" in rest and "serving `" not in rest and "Traceback" not in rest, rest
    finally:
        server.kill()
        server.wait()


def _files(root):
    """Every file's bytes under `root` and the time the workdir lock's record last changed: a refused run (which says
    "Nothing was changed") changes none of them."""
    files: dict = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    if (root / ".lock").exists():
        files["lock modified"] = (root / ".lock").stat().st_mtime_ns
    return files


def _loaded_model_reproduces_the_held_out_loss(workdir, val_loss, sites=1):
    """`experiments.load.trained_model` restores the final parameters (of each site of a federated run): the held-out
    loss recomputed from them (averaged over the sites) equals the summary's."""
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from experiments import build, load

    @nnx.jit
    def losses_of(model, tokens):
        return optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1])[0], tokens[:, 1:])

    losses = []
    for site in range(sites):
        config, model = load.trained_model(str(workdir), site=site)
        _, batches = build.build_data(config)
        val = batches.val_batches(config.train.eval_batches)
        losses.append(np.mean([np.asarray(losses_of(model, jnp.asarray(t)), np.float64) for t in val]))
    assert abs(np.mean(losses) - val_loss) < 1e-5, (losses, val_loss)
    if sites > 1:
        assert len(set(losses)) == sites  # different experts, different losses
        with pytest.raises(ValueError, match=f"site = {sites}: .* allowed 0..{sites - 1}"):
            load.trained_model(str(workdir), site=sites)


def _serve_streams_the_greedy_continuation(workdir, capsys, kv_format="bf16"):
    """`python -m experiments.serve` on the run: the streamed text of a greedy request is the prompt followed by
    what the serving engine generates for it from the loaded model with the same KV format (the engine equals
    `core.generate` with that cache: test_engine); a missing workdir exits 2 with a clear message."""
    from core.byte_tokenizer import ByteTokenizer
    from experiments import load
    from kvcache import formats
    from kvcache.serving import Engine, EngineConfig

    capsys.readouterr()  # what the training printed
    assert (
        serve.main(
            [
                f"--workdir={workdir}",
                "--prompt=def f",
                "--max-new-tokens=6",
                f"--kv-format={kv_format}",
                "--temperature=0",
                "--kv-memory-mib=1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    _, model = load.trained_model(str(workdir))
    tok = ByteTokenizer()
    # serve's pool (1 MiB holds this request's one block of 16 tokens; on the CPU a step's time grows with the pool)
    # and max_model_len (512): the engine's programs are the ones serve compiled
    engine = Engine(
        model, formats.get(kv_format), EngineConfig.for_tokenizer(tok, memory_bytes=1 << 20, max_model_len=512)
    )
    request = engine.submit(tok.encode("def f").tolist(), 6)
    engine.run()
    assert out.splitlines()[0] == "def f" + tok.decode(request.output)
    assert serve.main([f"--workdir={workdir}/nope", "--prompt=x"]) == 2
    assert "missing" in capsys.readouterr().err


def _exports_as_a_hugging_face_checkpoint(workdir, out, capsys):
    """`python -m experiments.hf export` writes the run's model as a Mixtral checkpoint; imported back, it computes
    the trained model's logits. (The mapping against transformers itself: test_hf's fixtures.)"""
    import jax
    import numpy as np

    from experiments import load, pretrained
    from experiments.hf import __main__ as hf_cli

    assert hf_cli.main(["export", f"--workdir={workdir}", f"--out={out}"]) == 0, capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    _, trained = load.trained_model(str(workdir))
    _, imported = pretrained.model_from_hf(str(out))
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 256)
    a, b = (np.asarray(jax.jit(lambda t, m=m: m(t)[0])(tokens)) for m in (trained, imported))
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max())


def _launch(workdir, *args):
    """The command line of `experiments.launch` running a 2-process run (one CPU device each) on 127.0.0.1."""
    return [sys.executable, "-m", "experiments.launch", "--processes", "2", "--"] + [
        f"--config={CONFIG}",
        f"--workdir={workdir}",
        *TINY,
        *args,
    ]


@pytest.mark.slow  # test_cluster's two srun tasks check the same equality (default run: 10 min)
def test_two_processes_equal_one_process_with_two_devices(tmp_path):
    """jax.distributed on 127.0.0.1 with gloo: 2 processes x 1 device train like 1 process x 2 devices. The MoE
    experts are sharded over the two devices, so the expert-parallel all-to-all crosses the processes."""
    args = [
        "--config.train.steps=6",
        "--config.train.eval_every=3",
        "--config.checkpoint.every=3",
        "--config.sample.num_tokens=0",
        "--config.mesh.data=1",
        "--config.mesh.expert=2",
    ]
    a = _run(tmp_path / "single", *args)  # this process, on 2 of its devices
    out = subprocess.run(
        _launch(tmp_path / "multi", *args), check=False, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "[0] model: " in out.stdout and "'expert': 2" in out.stdout, out.stdout + out.stderr
    b = json.loads((tmp_path / "multi" / "summary.json").read_text())
    assert b["devices"].startswith("2 x") and a["devices"].startswith("2 x")
    for key in ("train_loss", "val_loss", "val_bits_per_byte"):
        assert b[key] == pytest.approx(a[key], rel=1e-5), key


FEDERATED = [
    "--config.mesh.site=4",
    "--config.mesh.data=1",
    "--config.fomoe.overlap=2",
    "--config.fomoe.local_steps=3",
    "--config.train.steps=18",
    "--config.train.eval_every=9",
    "--config.sample.num_tokens=0",
]


def _rounds_checkpointed(steps, *extra):
    """FEDERATED's 4 sites (O_e = 2, K = 3) for `steps` steps, one evaluation at the end, a checkpoint every round."""
    return [
        *FEDERATED[:4],
        f"--config.train.steps={steps}",
        f"--config.train.eval_every={steps}",
        "--config.sample.num_tokens=0",
        "--config.checkpoint.every=3",
        *extra,
    ]


def test_federated_run_measures_its_bytes_and_resumes_after_a_crashed_round(tmp_path):
    """4 sites (O_e = 2, K = 3) with a random placement: the bytes read from the compiled round equal the formula
    plus what its reshuffles move, every 2 rounds; a crash right after round 2 and its reshuffle, and a rerun, give
    the same metrics (routing agreement included) and result as an uninterrupted run (with the same reshuffles). (A
    fixed placement's bytes: the composed-config test; its resume is this one's without reshuffles; rerunning a
    finished run: test_train, the same driver.)"""
    federated_run = [
        *FEDERATED,
        "--config.fomoe.placement=random",
        "--config.fomoe.reshuffle_every=2",
        "--config.checkpoint.every=6",  # every 2 rounds
    ]
    with _cache_programs_over(0.1):  # the crashed run and its rerun compile the same programs again
        summary = _run(tmp_path / "full", *federated_run)
    assert summary["rounds"] == 6 and summary["steps"] == 18
    rows = metric_rows(tmp_path / "full")
    assert [r["round"] for r in rows if "train_loss" in r] == list(range(1, 7))
    # the all-gather moves one copy of the other block's experts: 2x the expected arrivals (B = 2)
    moved = summary["bytes_per_site_migration_per_reshuffle"]
    assert moved == 2 * summary["bytes_per_site_migration_per_reshuffle_formula"] > 0
    assert summary["bytes_per_site_per_round"] - moved / 2 == pytest.approx(
        summary["bytes_per_site_per_round_formula"] - moved / 4
    )
    arrived = [r["reshuffle/arrived_experts_per_site"] for r in rows if "reshuffle/arrived_experts_per_site" in r]
    assert len(arrived) == 2 and all(0 <= a <= 4 for a in arrived) and any(a > 0 for a in arrived)

    crashed = tmp_path / "crashed"
    with pytest.raises(Crash):
        _run(crashed, *federated_run, hooks=[_crash_at(6)])
    resumed = _run(crashed, *federated_run)
    assert resumed["resumed_from"] == 6
    for key in ("train_loss", "val_loss", "val_bits_per_byte", "steps", "bytes_per_site_per_round"):
        assert resumed[key] == summary[key], key
    assert metric_rows(crashed) == rows


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param((), id="plain"),
        pytest.param(("--config.fomoe.moment_periods=(1, 2)",), marks=pytest.mark.slow, id="des_loc"),
    ],
)
def test_low_bit_synchronisation_with_error_feedback_resumes_exactly(tmp_path, extra):
    """4 sites (O_e = 2, K = 3) sending 4-bit (E2M1, UE8M0 scales, stochastic rounding) deltas with error feedback:
    the compiled round moves the formula's bytes, under a sixth of float32 synchronisation's; the feedback is in the
    checkpoint, so a crash after round 1 and a rerun give the uninterrupted run's metrics and result. With DES-LOC's
    periods (1, 2) (slow) round 1 averages the first moments only and round 2 both, each a change from the moments'
    last synchronised value (the anchor in the checkpoint): the rerun picks round 2's synchronisation by the
    schedule."""
    from core import checkpoint

    lowbit = _rounds_checkpointed(
        6,
        "--config.fomoe.sync_format=fp4",
        "--config.fomoe.sync_rounding=stochastic",
        "--config.fomoe.error_feedback=True",
        *extra,
    )
    with _cache_programs_over(0.1):
        summary = _run(tmp_path / "full", *lowbit)
    assert summary["bytes_per_site_per_round"] == summary["bytes_per_site_per_round_formula"] > 0
    flat = checkpoint.load_numpy(tmp_path / "full" / "checkpoints", 3)
    assert any(key.startswith("feedback/params/") for key in flat) and any("feedback/opt_state/" in k for k in flat)
    assert max(np.abs(v).max() for k, v in flat.items() if k.startswith("feedback/")) > 0
    crashed = tmp_path / "crashed"
    with pytest.raises(Crash):
        _run(crashed, *lowbit, hooks=[_crash_at(3)])
    resumed = _run(crashed, *lowbit)
    assert resumed["resumed_from"] == 3
    for key in ("train_loss", "val_loss", "val_bits_per_byte"):
        assert resumed[key] == summary[key], key
    rows = metric_rows(tmp_path / "full")
    assert metric_rows(crashed) == rows
    for row in (r for r in rows if "train_loss" in r):  # the routing-health metrics of every round
        assert math.isfinite(row["sync/loss_jump"]) and 0 <= row["routing/js_divergence"] <= math.log(2)
        assert 0 < row["routing/utilisation_entropy"] <= 1


@pytest.mark.slow  # 26 s; the low-bit and crashed-round runs check resuming exactly (default run: 10 min)
def test_streaming_fragments_behind_compute_resume_exactly(tmp_path):
    """4 sites (O_e = 2, K = 3, 2 blocks) synchronising F = 2 fragments in turn in fp4 with error feedback, each
    behind the next round's local steps (delay 1, mixing 0.5, second moments local): a round moves its fragment's
    formula bytes (their sum over the fragments is a whole synchronisation's: test_streaming) and the first one
    nothing; a crash after round 2 and a rerun (the fragments' anchors and error feedback restored) give the
    uninterrupted run's metrics and result."""
    streaming_run = _rounds_checkpointed(
        9,
        "--config.model.num_layers=2",
        "--config.fomoe.fragments=2",
        "--config.fomoe.delay=1",
        "--config.fomoe.mixing=0.5",
        "--config.fomoe.second_moments=local",
        "--config.fomoe.sync_format=fp4",
        "--config.fomoe.error_feedback=True",
    )
    with _cache_programs_over(0.1):
        summary = _run(tmp_path / "full", *streaming_run)
    assert summary["bytes_per_site_per_round"] == summary["bytes_per_site_per_round_formula"] > 0
    with open(tmp_path / "full" / "metrics.jsonl") as f:
        syncs = [r["seconds/sync"] for r in map(json.loads, f) if "train_loss" in r]
    assert syncs[0] == 0.0 and all(s > 0 for s in syncs[1:])  # round 1 has nothing to average yet
    crashed = tmp_path / "crashed"
    with pytest.raises(Crash):
        _run(crashed, *streaming_run, hooks=[_crash_at(6)])
    resumed = _run(crashed, *streaming_run)
    assert resumed["resumed_from"] == 6
    for key in ("train_loss", "val_loss", "val_bits_per_byte"):
        assert resumed[key] == summary[key], key
    assert metric_rows(crashed) == metric_rows(tmp_path / "full")


def test_a_federation_that_lost_a_site_is_regrouped_and_finishes_on_the_survivors(tmp_path, capsys):
    """4 sites (O_e = 2, K = 3) stop after round 1; `experiments.elastic` regroups the checkpoint onto the 3 left (site
    2 lost; O_e 2 -> 3: every expert kept), and the run, rerun with the flags it prints, resumes from step 3 and
    finishes on 3 sites; the 4-site checkpoints are kept and history.jsonl records the regrouping. Refused: a lost
    site outside the run's, and a run without a checkpoint (each named)."""
    from experiments import elastic

    args = _rounds_checkpointed(6)
    work = tmp_path / "fed"
    with pytest.raises(Crash):
        _run(work, *args, hooks=[_crash_at(3)])
    assert elastic.main(["--workdir", str(work), "--sites", "3", "--lost", "7"]) == 2
    assert "--lost [7]: the run's sites are 0..3" in capsys.readouterr().err
    assert elastic.main(["--workdir", str(work), "--sites", "3", "--lost", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 -> 3 sites, O_e 2 -> 3; lost site 2" in out and "every expert kept" in out, out
    flags = out.split("rerun with: ")[1].split()
    assert flags == ["--config.mesh.site=3", "--config.fomoe.overlap=3", "--config.data.batch_size=6"]
    summary = _run(work, *args, *flags)
    assert summary["resumed_from"] == 3 and summary["steps"] == 6 and math.isfinite(summary["val_loss"])
    assert json.loads((work / "config.json").read_text())["mesh"]["site"] == 3
    assert (work / "checkpoints.sites-4").is_dir()
    history = [json.loads(line) for line in (work / "history.jsonl").read_text().splitlines()]
    assert history[-1]["regrouped"]["lost"] == [2] and history[-1]["regrouped"]["overlap"] == 3
    assert elastic.main(["--workdir", str(tmp_path / "none"), "--sites", "3"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_a_federation_of_a_dense_model_trains_without_a_routing_probe(tmp_path):
    """moe.every = 0 under mesh.site > 1 (the quickstart's dense variant): the sites train full replicas with
    LocalAdamW rounds; there is no routing to probe (no routing metric), and the round moves the formula's bytes."""
    dense = ["--config.mesh.site=2", "--config.mesh.data=1", "--config.moe.every=0", "--config.fomoe.local_steps=3"]
    summary = _run(tmp_path / "dense", *dense, "--config.train.steps=6", "--config.train.eval_every=3")
    assert summary["rounds"] == 2 and math.isfinite(summary["val_loss"])
    rows = metric_rows(tmp_path / "dense")
    assert [r["round"] for r in rows if "train_loss" in r] == [1, 2]
    assert not any(key.startswith("routing/") for r in rows for key in r)
    assert summary["bytes_per_site_per_round"] == summary["bytes_per_site_per_round_formula"] > 0


def test_the_composed_config_trains_sites_with_mgup_on_ufp4_and_serves_through_fp4_kv(tmp_path, capsys):
    """experiments/configs/composed.py end to end: 2 federated sites train with MGUP-AdamW on UFP4 GEMMs (the run
    records all three choices) and measure exactly the formula's bytes, the loaded model reproduces the held-out
    loss, and serving it through the fp4 KV cache streams the engine's greedy continuation with that cache."""
    workdir = tmp_path / "composed"
    summary = _run(
        workdir,
        "--config.mesh.site=2",
        "--config.mesh.data=1",
        "--config.fomoe.local_steps=2",
        "--config.train.steps=6",
        "--config.train.eval_every=6",
        "--config.model.d_model=64",
        "--config.model.num_heads=1",
        "--config.model.num_kv_heads=1",
        "--config.sample.num_tokens=0",  # (generation through the fp4 cache: serve, below)
        config=COMPOSED,
    )
    config = json.loads((workdir / "config.json").read_text())
    assert (config["optim"]["name"], config["precision"]["recipe"], config["kvcache"]["format"]) == (
        "mgup_adamw",
        "ufp4",
        "fp4",
    )
    assert summary["rounds"] == 3
    assert summary["bytes_per_site_per_round"] == summary["bytes_per_site_per_round_formula"] > 0
    _loaded_model_reproduces_the_held_out_loss(workdir, summary["val_loss"], sites=2)
    _serve_streams_the_greedy_continuation(workdir, capsys, kv_format="fp4")


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--config.fomoe.overlap=3"], ["fomoe.overlap", "3", "mesh.site", "4"]),
        (["--config.fomoe.local_steps=4"], ["train.steps", "18", "fomoe.local_steps", "4"]),
        (["--config.fomoe.outer=fedavg"], ["fomoe.outer", "fedavg", "local_adamw"]),
        (
            ["--config.fomoe.overlap=4", "--config.fomoe.placement=random"],
            ["fomoe.placement", "fomoe.overlap", "fixed"],
        ),
        (["--config.fomoe.placement=rand"], ["fomoe.placement", "'rand'", "random"]),
        (["--config.fomoe.error_feedback=True"], ["fomoe.error_feedback", "fomoe.sync_format", "'float32'"]),
        (["--config.fomoe.fragments=2"], ["fomoe.fragments", "2", "model.num_layers", "1"]),
        (["--config.fomoe.delay=1"], ["fomoe.delay", "fomoe.second_moments", "'local'"]),
        (
            ["--config.fomoe.moment_periods=(3, 1)", "--config.fomoe.delay=1", "--config.fomoe.second_moments=local"],
            ["fomoe.moment_periods", "(3, 1)", "'fomoe.delay' = 0"],
        ),
        (
            [
                "--config.fomoe.moment_periods=(3, 6)",
                "--config.fomoe.outer=diloco",
                "--config.fomoe.sync_format=int8",
            ],
            ["fomoe.sync_format", "'int8'", "DiLoCo's inner moments", "'float32'"],
        ),
        (["--config.fomoe.moment_periods=(0, 6)"], ["fomoe.moment_periods", "(0, 6)", "two positive integers"]),
        (["--config.fomoe.sync_format=fp8"], ["fomoe.sync_format", "'fp8'", "'int4'"]),
        (["--config.fomoe.sync_format=fp4", "--config.fomoe.sync_block=15"], ["fomoe.sync_block", "15", "even"]),
        (
            ["--config.fomoe.sync_format=topk2", "--config.fomoe.sync_scale=fp32"],
            ["fomoe.sync_keep", "= 0", "1..block"],
        ),
        (["--config.fomoe.outer=spes"], ["fomoe.overlap", "'spes'"]),
        (["--config.fomoe.merge_alpha=0.1"], ["fomoe.merge_alpha", "0.1", "'spes'", "0.05"]),
        (["--config.fomoe.feedback_decay=0.9"], ["fomoe.feedback_decay", "0.9", "fomoe.error_feedback"]),
        (
            ["--config.fomoe.sync_format=int8", "--config.fomoe.placement=random"],
            ["fomoe.placement", "'random'", "'fixed'", "sync_format"],
        ),
    ],
)
def test_bad_federated_flags_are_rejected(capsys, tmp_path, args, needles):
    code, err = _main(capsys, f"--config={CONFIG}", f"--workdir={tmp_path}", *TINY, *FEDERATED, *args)
    assert code == 2, err
    for needle in needles:
        assert needle in err, (needle, err)


def _child_running(root, *needle):
    """The pid of a descendant of `root` running `needle` (experiments.cluster.process.descendant), asserted."""
    from experiments.cluster import process

    pid = process.descendant(root, *needle)
    assert pid is not None, f"no descendant of {root} runs {needle}"
    return pid


@pytest.mark.slow  # 40 s of real processes and links; the default run keeps test_cluster's two processes against one
def test_sites_as_processes_train_like_virtual_devices_and_survive_a_lost_site(tmp_path):
    """`experiments.launch` starts one process per site (jax.distributed, gloo), each in its own network namespace
    behind a real 100 Mbit/s link (`experiments.links run --in-hub ... launch --links`; where networks cannot be
    made, e.g. without root, on 127.0.0.1). Killing one site's process mid-run stops the other within 60 s with a
    clear error (no hang); launching the same command again resumes from the last completed round, and the run ends
    exactly like one process with a device per site: same losses, same held-out result, same measured bytes; over
    the links, each site's link carried at least those bytes."""
    args = [
        "--config.mesh.site=2",
        "--config.mesh.data=1",
        "--config.fomoe.overlap=1",
        "--config.fomoe.local_steps=3",
        "--config.train.steps=18",
        "--config.train.eval_every=9",
        "--config.checkpoint.every=3",
        "--config.sample.num_tokens=0",
    ]
    a = _run(tmp_path / "single", *args)  # this process, a device per site
    command = _launch(tmp_path / "multi", *args)
    over_links = links.unavailable() is None
    if over_links:
        report = tmp_path / "links.json"
        command = [
            *(sys.executable, "-m", "experiments.links", "run", "--sites", "2", "--rate-mbit", "100", "--in-hub"),
            *("--report", str(report), "--"),
            *command[:5],
            "--links",
            *command[5:],
        ]
    first = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while not (tmp_path / "multi" / "checkpoints" / "3").exists():  # the first round's; 5 rounds remain
        assert first.poll() is None, first.communicate()[0]
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(_child_running(first.pid, "--config.mesh.process_id=1"), signal.SIGKILL)
    t0 = time.time()
    out = first.communicate(timeout=120)[0]
    assert time.time() - t0 < 60 and first.returncode != 0, out
    assert "another process has probably died" in out and "rerun the same command" in out
    assert "launch: process 1 was killed by signal SIGKILL" in out and "launch: exit codes [1, SIGKILL]" in out, out

    again = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "launch: exit codes [0, 0]" in again.stdout, again.stdout + again.stderr
    assert "[1] " in again.stdout
    b = json.loads((tmp_path / "multi" / "summary.json").read_text())
    assert 3 <= b["resumed_from"] < 18 and b["rounds"] == 6 and b["devices"].startswith("2 x")
    for key in ("train_loss", "val_loss", "val_bits_per_byte", "bytes_per_site_per_round"):
        assert b[key] == pytest.approx(a[key], rel=1e-6), key
    if over_links:  # the resumed run's rounds crossed the links: each site sent at least their compiled bytes
        rounds = b["rounds"] - b["resumed_from"] // 3
        sent = [site["tx_wire_bytes"] for site in json.loads(report.read_text())["counters"]]
        assert min(sent) >= rounds * b["bytes_per_site_per_round"], (sent, rounds, b["bytes_per_site_per_round"])


@pytest.mark.slow  # 37 s of real processes; the default run keeps the in-process regrouping
def test_an_elastic_launch_goes_on_without_a_killed_site(tmp_path):
    """`experiments.launch --elastic` with 3 sites (full replicas, K = 3): killing site 1's process after the first
    round's checkpoint, the launcher regroups that checkpoint onto the 2 survivors (O_e 3 -> 2: every expert kept),
    says so, starts them again, and the run finishes on 2 sites from the checkpoint, without a manual step."""
    args = [
        "--config.mesh.site=3",
        "--config.mesh.data=1",
        "--config.fomoe.overlap=3",
        "--config.fomoe.local_steps=3",
        "--config.data.batch_size=6",
        "--config.train.steps=9",
        "--config.train.eval_every=9",
        "--config.checkpoint.every=3",
        "--config.sample.num_tokens=0",
    ]
    work = tmp_path / "elastic"
    command = _launch(work, *args)
    command[3:5] = ["--processes", "3", "--elastic"]
    first = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while not (work / "checkpoints" / "3").exists():
        assert first.poll() is None, first.communicate()[0]
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(_child_running(first.pid, "--config.mesh.process_id=1"), signal.SIGKILL)
    out = first.communicate(timeout=400)[0]
    assert first.returncode == 0, out
    assert "launch: --elastic: site 1 was lost: its process was killed by SIGKILL; regrouping" in out, out
    assert "3 -> 2 sites, O_e 3 -> 2; lost site 1" in out and "every expert kept" in out, out
    assert out.rstrip().endswith("launch: exit codes [0, 0]"), out[-2000:]
    summary = json.loads((work / "summary.json").read_text())
    assert summary["resumed_from"] == 3 and summary["steps"] == 9 and summary["devices"].startswith("2 x")
