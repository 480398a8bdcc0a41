"""`mesh.num_processes = -1`: the processes of the cluster environment (core.mesh.resolve_processes).

The config's errors and the values read from SLURM's and Open MPI's variables are checked in this process, starting
nothing. One test starts two `python -m experiments.run` processes with the variables srun gives a 2-task step on one
node (the coordinator on 'localhost') and compares their run with one process on 2 devices.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from test_cli import CONFIG, ROOT, TINY, _run

from core import fields as fields_lib
from core import jax_compat
from core import mesh as mesh_lib
from experiments import schema

CLUSTER_VARIABLES = ("SLURM_", "OMPI_", "TPU_", "KUBERNETES_SERVICE_HOST", "JAX_COORDINATOR_", "JAX_LOCAL_DEVICE_IDS")
"""What jax's cluster detection reads (core.jax_compat.cluster_environments): removed from each test's environment,
so that a test run inside a SLURM job or a Kubernetes pod sees only what the test sets."""


@pytest.fixture
def cluster_env(monkeypatch):
    """Sets the cluster variables of this process to the given dict (and nothing else of theirs)."""

    def set_env(values):
        for key in list(os.environ):
            if key.startswith(CLUSTER_VARIABLES):
                monkeypatch.delenv(key)
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return set_env


def _config(**mesh):
    c = schema.default_config()
    c.mesh.update(mesh)
    return c


@pytest.mark.parametrize(
    "mesh, needles",
    [
        ({"num_processes": -1, "process_id": 1}, ["'mesh.process_id' = 1", "'mesh.num_processes' = -1", "remove it"]),
        (
            {"num_processes": -1, "coordinator_address": "node1:1234"},
            ["'mesh.coordinator_address' = 'node1:1234'", "mesh.num_processes = N"],
        ),
        ({"num_processes": 0}, ["'mesh.num_processes' = 0", "-1"]),
        ({"num_processes": -2}, ["'mesh.num_processes' = -2", "[-1, inf)"]),
    ],
)
def test_bad_process_keys_are_refused(mesh, needles):
    with pytest.raises(fields_lib.ConfigError) as e:
        schema.validate(_config(**mesh))
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_outside_a_cluster_minus_one_names_the_key_the_environments_and_the_fix(cluster_env):
    cluster_env({})
    config = _config(num_processes=-1)
    schema.validate(config)  # the form is fine; what it needs is checked when it is resolved
    with pytest.raises(fields_lib.ConfigError) as e:
        mesh_lib.resolve_processes(config)
    for needle in ("'mesh.num_processes' = -1", "none is detected", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "srun"):
        assert needle in str(e.value), (needle, str(e.value))
    for flag in ("num_processes=N", "process_id=i", "coordinator_address=host:port"):
        assert f"--config.mesh.{flag}" in str(e.value)
    assert config.mesh.num_processes == -1


SLURM = {  # a task of `srun -N 5 -n 4` (job 1234): the coordinator is the first node, port 61440 + 1234 mod 4096
    "SLURM_JOB_ID": "1234",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_NODELIST": "node[003-007],gpu1",
}
OMPI = {  # rank 2 of 3 under mpirun: the launcher's first address, port 61440 + (1531576320 / 4096) mod 4096
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
    "OMPI_COMM_WORLD_SIZE": "3",
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
}


@pytest.mark.parametrize(
    "env, expected",
    [
        (SLURM, (4, 3, "node003:62674", "SlurmCluster")),
        ({**SLURM, "JAX_COORDINATOR_PORT": "7000"}, (4, 3, "node003:7000", "SlurmCluster")),
        ({**OMPI, **SLURM}, (3, 2, "10.96.0.1:62624", "OmpiCluster")),  # jax tries Open MPI first
    ],
)
def test_the_cluster_variables_fill_in_the_process_keys_as_jax_reads_them(cluster_env, capsys, env, expected):
    auto_detect = jax_compat.lookup("jax._src.clusters.ClusterEnv.auto_detect_unset_distributed_params")
    cluster_env(env)
    config = _config(num_processes=-1)
    mesh_lib.resolve_processes(config)
    got = (config.mesh.num_processes, config.mesh.process_id, config.mesh.coordinator_address)
    assert got == expected[:3]
    # what jax.distributed.initialize() without arguments would use
    assert auto_detect(None, None, None, None, None, 300)[:3] == (
        expected[2],
        expected[0],
        expected[1],
    )
    assert f"cluster: {expected[3]}: process {expected[1]} of {expected[0]}" in capsys.readouterr().out
    config.data.batch_size = 4 * expected[0] + 1  # the process-count checks, deferred under -1, now apply
    with pytest.raises(fields_lib.ConfigError, match=rf"data.batch_size.*'mesh.num_processes' = {expected[0]}"):
        schema.validate(config)


def test_inconsistent_cluster_variables_are_refused(cluster_env):
    cluster_env({**SLURM, "SLURM_PROCID": "4"})
    with pytest.raises(fields_lib.ConfigError, match=r"'mesh.num_processes' = -1: .*SLURM_PROCID.* process 4 of 4"):
        mesh_lib.resolve_processes(_config(num_processes=-1))


def _slurm_port():
    """A free port among those jax's SlurmCluster derives from a job id (61440 + SLURM_JOB_ID mod 4096)."""
    for offset in range(os.getpid() % 4096, os.getpid() % 4096 + 4096):
        port = 61440 + offset % 4096
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port in 61440..65535")


def test_two_srun_tasks_train_like_one_process_with_two_devices(tmp_path):
    """The same command in two processes with the variables of a 2-task SLURM step on one node ('localhost'):
    each learns its index from SLURM_PROCID, the coordinator from the node list and job id, and they train like one
    process on 2 devices (data parallel over the two processes: the gradients' all-reduce crosses them). A dense
    model (moe.every=0) compiles in a fraction of the MoE's time; tests/test_cli.py shards experts over processes."""
    args = [
        "--config.train.steps=2",
        "--config.train.eval_every=2",
        "--config.train.tensorboard=False",
        "--config.checkpoint.every=2",
        "--config.sample.num_tokens=0",
        "--config.moe.every=0",
        "--config.mesh.data=2",
    ]
    a = _run(tmp_path / "single", *args)  # this process, on 2 of its devices
    port = _slurm_port()
    job = 4096 * 100 + port - 61440
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    base = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARIABLES)}
    base.update(
        PYTHONUNBUFFERED="1",
        XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=1"]),
        SLURM_JOB_ID=str(job),
        SLURM_NTASKS="2",
        SLURM_STEP_NODELIST="localhost",
        SLURM_STEP_NUM_NODES="1",
    )
    cmd = [sys.executable, "-m", "experiments.run", f"--config={CONFIG}", f"--workdir={tmp_path / 'multi'}", *TINY]
    cmd += [*args, "--config.mesh.num_processes=-1"]
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = []
    try:
        for i, log_path in enumerate(logs):
            with open(log_path, "w") as out:
                env = {**base, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 240  # a bound, not a measurement: a hung start must not hang the suite
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:  # one failed (the other would wait for it until jax.distributed's timeout), or the bound passed:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    outs = [log_path.read_text() for log_path in logs]
    log = "\n".join(f"--- process {i}\n{out}" for i, out in enumerate(outs))
    assert [p.returncode for p in procs] == [0, 0], log
    for i, out in enumerate(outs):
        assert f"cluster: SlurmCluster: process {i} of 2, coordinator localhost:{port}" in out, log
    assert "'data': 2" in outs[0], log
    recorded = json.loads((tmp_path / "multi" / "config.json").read_text())["mesh"]
    assert (recorded["num_processes"], recorded["process_id"]) == (2, 0)
    b = json.loads((tmp_path / "multi" / "summary.json").read_text())
    assert b["devices"].startswith("2 x") and a["devices"].startswith("2 x")
    for key in ("train_loss", "val_loss", "val_bits_per_byte"):
        assert b[key] == pytest.approx(a[key], rel=1e-5), key
