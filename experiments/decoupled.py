"""Decoupled DiLoCo on this machine (arXiv 2604.21428): `mesh.site` learner processes train on their own clocks,
with no collective, and a synchroniser in this process merges their fragments (moe.decoupled) over TCP.

    python -m experiments.decoupled [--quorum Q] [--grace S] [--fail L@R[:DOWN]] [--links] -- \\
        --config experiments/configs/fomoe.py --config.mesh.site=4 --config.fomoe.overlap=4 \\
        --config.fomoe.outer=diloco --workdir runs/decoupled

The run's config is a federated one: M = mesh.site learners, each the full model (fomoe.overlap = M) on its share
of every global batch; every fomoe.local_steps steps a learner sends one fragment's pseudo-gradient (fragment
r mod fomoe.fragments in its round r, moe.streaming.fragments) and adopts the fragment sent back; the outer
optimizer is DiLoCo's (fomoe.outer = "diloco": Nesterov at fomoe.outer_learning_rate, fomoe.outer_momentum), one
state per fragment. What this runner does not do (low-bit formats, error feedback, delay, moment periods, LocalAdamW,
SPES, partitioned experts, several processes per learner) is refused by its config key before anything starts.

--quorum Q (default M): a merge takes Q distinct learners; --grace S (default 5): seconds a reached quorum waits
for the other live learners. --fail L@R[:DOWN] (repeatable): learner L's process is killed (SIGKILL) when its
R-th push arrives (that push is merged), and started again DOWN seconds later (never without :DOWN); a restarted
learner compiles, then joins at the furthest step any learner has pushed, with the current global fragments and a
fresh inner optimizer state whose updates ramp up over fomoe.arrival_warmup steps. A learner that exits with an
error stops the run (exit 1, its log's tail printed).

Written to --workdir: config.json and data.json (the run's records), learner_<m>.log, metrics.jsonl (held-out loss
of the global model every train.eval_every steps, evaluated after training), merges.jsonl (every merge: time,
fragment, learners, tokens, staleness), summary.json: val_loss, the bytes a learner sends per round (the fragment
values' float32 bytes, measured on the socket, and by the formula; the pickled headers aside), useful tokens (those
in merged contributions; the last ones that reach no quorum are dropped and counted apart), wall seconds, goodput
(useful tokens per wall second) and tokens_per_second. Progress: one line per merge.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener
from typing import ClassVar

import jax
import numpy as np

from core import fields as fields_lib
from core import workdir as workdir_lib
from experiments import args as args_lib
from experiments import build, command, load, schema
from experiments.cluster import supervisor
from experiments.decoupled_learner import (
    AUTHKEY_ENV,
    fragment_leaves,
    learner_config,
    put_fragment,
    recv_arrays,
    send_arrays,
)
from moe.decoupled import Contribution, Synchroniser

__all__ = ["Runner", "check_config", "main", "parse_failures", "score_snapshots"]

_REFUSED = {  # config key: (the value this runner implements, why)
    "fomoe.outer": ("diloco", "learners take DiLoCo's outer step"),
    "fomoe.sync_format": ("float32", "fragments travel in float32"),
    "fomoe.error_feedback": (False, "no error feedback"),
    "fomoe.delay": (0, "a learner adopts the merged fragment before it goes on"),
    "fomoe.moment_periods": ((1, 1), "no moment is sent"),
    "fomoe.placement": ("fixed", "every learner holds every expert"),
    "mesh.num_processes": (1, "one process per learner, started here"),
}


def check_config(config) -> None:
    """Refuses (ConfigError naming the key, its value and what is allowed) what this runner does not implement."""
    for key, (allowed, why) in _REFUSED.items():
        section, name = key.split(".")
        value = config[section][name]
        value = tuple(value) if isinstance(value, list) else value
        if value != allowed:
            raise fields_lib.ConfigError(
                f"config key '{key}' = {value!r}: Decoupled DiLoCo allows {allowed!r} ({why})."
            )
    if config.fomoe.overlap != config.mesh.site:
        raise fields_lib.ConfigError(
            f"config key 'fomoe.overlap' = {config.fomoe.overlap}: Decoupled DiLoCo learners are full replicas, "
            f"allowed mesh.site ({config.mesh.site})."
        )


def parse_failures(values: list[str], learners: int) -> dict[int, tuple[int, float | None]]:
    """{learner: (push count, seconds down or None)} from `L@R[:DOWN]` values; raises UsageError naming --fail."""
    out: dict[int, tuple[int, float | None]] = {}
    for v in values:
        try:
            who, rest = v.split("@")
            when, _, down = rest.partition(":")
            learner, push, seconds = int(who), int(when), (float(down) if down else None)
        except ValueError:
            raise args_lib.UsageError(f"--fail {v!r}: expected L@R or L@R:DOWN (learner, push, seconds down)") from None
        if not 0 <= learner < learners or push < 1 or (seconds is not None and seconds < 0) or learner in out:
            raise args_lib.UsageError(
                f"--fail {v!r}: learner 0..{learners - 1} (once each), push >= 1, seconds down >= 0"
            )
        out[learner] = (push, seconds)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quorum", type=args_lib.integer(1), help="learners a merge takes (default mesh.site)")
    parser.add_argument("--grace", type=args_lib.number(0.0), default=5.0, help="seconds (default %(default)s)")
    parser.add_argument("--fail", action="append", default=[], metavar="L@R[:DOWN]", help="inject a failure")
    parser.add_argument(
        "--links",
        action="store_true",
        help="learner m runs in site m's network namespace of `python -m experiments.links run --in-hub -- <this "
        "command>`, the synchroniser on the hub's address",
    )
    own = parser.parse_args(argv[:split])
    run_args = argv[split + 1 :]
    try:
        config, workdir = args_lib.parse_run_args(["decoupled", *run_args])
        schema.validate(config)
        check_config(config)
        quorum = config.mesh.site if own.quorum is None else own.quorum
        if quorum > config.mesh.site:
            raise args_lib.UsageError(f"--quorum {quorum}: allowed 1..mesh.site ({config.mesh.site})")
        failures = parse_failures(own.fail, config.mesh.site)
        netns, host = supervisor.site_network(config.mesh.site) if own.links else ([], "127.0.0.1")
    except (args_lib.UsageError, fields_lib.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(workdir, exist_ok=True)
    return Runner(config, workdir, run_args, quorum, own.grace, failures, host, netns=netns).run()


class Runner:
    """The synchroniser's event loop and the learners' processes (see the module docstring). `learner` is the
    command a learner runs (before its `--learner M --address HOST:PORT -- <run arguments>`) and `score` what
    scores the global parameters at the end (`score_snapshots`' signature); tests pass stand-ins."""

    learner: ClassVar[list[str]] = [sys.executable, "-m", "experiments.decoupled_learner"]

    def __init__(self, config, workdir, run_args, quorum, grace, failures, host, *, netns=(), score=None):
        self.score, self.netns = score or score_snapshots, list(netns)
        self.config, self.workdir, self.run_args = config, workdir, run_args
        self.quorum, self.grace, self.failures = quorum, grace, dict(failures)
        self.key = secrets.token_hex(16)
        self.listener = Listener((host, 0), authkey=bytes.fromhex(self.key))
        self.events: queue.Queue = queue.Queue()
        self.procs: dict[int, subprocess.Popen] = {}
        self.conns: dict[int, object] = {}
        self.restart_at: dict[int, float] = {}
        self.pushes = dict.fromkeys(range(config.mesh.site), 0)
        self.sync: Synchroniser | None = None
        self.shapes: list = []
        self.progress, self.seen, self.dropped = 0, 0, []
        self.sent: dict[int, list[int]] = {}  # fragment: [bytes, pushes]
        self.evals: list[tuple[int, list]] = []  # (step, the global fragments) at each evaluation step crossed

    def run(self) -> int:
        for name in os.listdir(self.workdir):  # a fresh start: no record of an earlier attempt is mixed in
            if name in ("merges.jsonl", "summary.json", "metrics.jsonl") or name.startswith("learner_"):
                os.remove(os.path.join(self.workdir, name))
        threading.Thread(target=self._accept, daemon=True).start()
        self.started = time.time()
        for m in range(self.config.mesh.site):
            self._start(m)
        try:
            code = self._loop()
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
            self.listener.close()
        if code == 0:
            self._report()
        return code

    def _start(self, m: int, joining: bool = False) -> None:
        log = os.path.join(self.workdir, f"learner_{m}.log")
        address = f"{self.listener.address[0]}:{self.listener.address[1]}"
        cmd = [*self.learner, "--learner", str(m), "--address", address, *(["--joining"] if joining else [])]
        cmd = ["ip", "netns", "exec", self.netns[m], *cmd] if self.netns else cmd
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]  # one device each
        env = {**os.environ, AUTHKEY_ENV: self.key, "XLA_FLAGS": " ".join(flags)}
        with open(log, "a") as out:  # the child keeps its own descriptor
            self.procs[m] = subprocess.Popen(
                [*cmd, "--", *self.run_args], stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn) -> None:
        learner = None
        try:
            while True:
                message = conn.recv()
                if message[0] == "hello":
                    learner = message[1]
                    self.events.put(("hello", conn, message))
                elif message[0] == "push":
                    self.events.put(
                        ("push", conn, (message[1], recv_arrays(conn, self.shapes[message[1]["fragment"]])))
                    )
                else:
                    self.events.put((message[0], conn, message))
        except (EOFError, OSError):
            self.events.put(("lost", conn, learner))

    def _loop(self) -> int:
        done: set[int] = set()
        while True:
            now = time.time()
            for m, at in list(self.restart_at.items()):
                if now >= at:
                    del self.restart_at[m]
                    print(f"[{now - self.started:7.1f} s] learner {m} restarted", flush=True)
                    self._start(m, joining=True)
            for m, p in self.procs.items():
                if p.poll() not in (None, 0, -signal.SIGKILL):
                    with open(os.path.join(self.workdir, f"learner_{m}.log")) as f:
                        tail = f.read()[-2000:]
                    print(f"error: learner {m} exited with status {p.returncode}:\n{tail}", file=sys.stderr)
                    return 1
            if len(done) == self.config.mesh.site and not self.restart_at:
                if self.sync is not None:
                    replies, self.dropped = self.sync.finish(time.time())
                    self._replies(replies)
                return 0
            deadline = self.sync.deadline() if self.sync else None
            wait = 0.5 if deadline is None else min(0.5, max(0.0, deadline - now))
            try:
                kind, conn, payload = self.events.get(timeout=wait)
            except queue.Empty:
                if self.sync is not None:
                    self._replies(self.sync.poll(time.time()))
                continue
            if kind == "hello":
                self._hello(conn, payload)
            elif kind == "push":
                self._push(payload)
            elif kind == "done":
                done.add(payload[1])
            elif kind == "lost" and payload is not None and payload not in done and self.conns.get(payload) is conn:
                del self.conns[payload]  # (a restarted learner's new connection is not the one lost)
                if self.sync is not None:
                    self._replies(self.sync.leave(payload, time.time()))
                if payload not in self.restart_at:
                    done.add(payload)  # lost for good: not waited for at the end

    def _hello(self, conn, message) -> None:
        _, m, header = message
        if self.sync is None:  # every learner starts from the same initial parameters (train.seed)
            self.shapes = header["shapes"]
            f = self.config.fomoe
            outer = build.build_outer_optimizer(self.config)
            self.sync = Synchroniser(header["initial"], outer, learners=self.config.mesh.site, quorum=self.quorum,
                                     grace=self.grace)  # fmt: skip
            self.formula = 4 * sum(int(np.prod(s)) for shapes in self.shapes for s in shapes) / f.fragments
        self.conns[m] = conn
        replies = self.sync.join(m)
        conn.send(("start", self.progress, [r.version for r in replies]))
        for r in replies:
            conn.send_bytes(b"".join(np.ascontiguousarray(a, np.float32).tobytes() for a in r.params))

    def _push(self, payload) -> None:
        header, delta = payload
        m = header["learner"]
        self.pushes[m] += 1
        sent = self.sent.setdefault(header["fragment"], [0, 0])
        sent[0] += sum(d.nbytes for d in delta)
        sent[1] += 1
        self.progress = max(self.progress, header["call"])
        c = Contribution(m, header["fragment"], delta, header["tokens"], header["steps"], header["base"])
        self._replies(self._synchroniser().submit(c, time.time()))
        if m in self.failures and self.pushes[m] == self.failures[m][0]:
            push, down = self.failures.pop(m)
            print(f"[{time.time() - self.started:7.1f} s] learner {m} killed at its push {push}", flush=True)
            self.procs[m].kill()
            if down is not None:
                self.restart_at[m] = time.time() + down

    def _synchroniser(self) -> Synchroniser:
        if self.sync is None:
            raise RuntimeError("no learner has said hello yet")
        return self.sync

    def _replies(self, replies) -> None:
        for merge in self._synchroniser().merges[self.seen :]:
            self._merged(merge)
        for r in replies:
            conn = self.conns.get(r.learner)
            if conn is not None:
                with contextlib.suppress(OSError):  # lost: its reader reports it
                    send_arrays(conn, ("fragment", r.fragment, r.version), r.params)

    def _merged(self, merge) -> None:
        self.seen += 1
        every, last = self.config.train.eval_every, self.evals[-1][0] if self.evals else 0
        if self.progress // every > last // every:
            snapshot = [[a.copy() for a in f] for f in self._synchroniser().params]
            self.evals.append((self.progress // every * every, snapshot))
        with open(os.path.join(self.workdir, "merges.jsonl"), "a") as f:
            f.write(json.dumps({**merge.__dict__, "time": merge.time - self.started, "step": self.progress}) + "\n")
        print(
            f"[{merge.time - self.started:7.1f} s] merge {self.seen}: fragment {merge.fragment} v{merge.version} "
            f"from learners {list(merge.learners)} (staleness {list(merge.staleness)}), step {self.progress}",
            flush=True,
        )

    def _report(self) -> None:
        wall = time.time() - self.started
        merged = sum(x.tokens for x in self._synchroniser().merges)
        steps = self.config.train.steps
        metrics = self.score(
            self.config, self.workdir, [e for e in self.evals if e[0] < steps] + [(steps, self._synchroniser().params)]
        )
        with open(os.path.join(self.workdir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps({"step": s, "val_loss": v}) + "\n" for s, v in metrics)
        summary = {
            "val_loss": metrics[-1][1],
            "bytes_per_site_per_round": float(np.mean([b / n for b, n in self.sent.values()])),
            "bytes_per_site_per_round_formula": self.formula,
            "useful_tokens": merged,
            "dropped_tokens": sum(c.tokens for c in self.dropped),  # sent after the last merge, below the quorum
            "wall_seconds": wall,
            "goodput_tokens_per_second": merged / wall,
            "tokens_per_second": merged / wall,
            "merges": len(self._synchroniser().merges),
            "quorum": self.quorum,
            "grace_seconds": self.grace,
        }
        workdir_lib.write_json(os.path.join(self.workdir, "summary.json"), summary)
        print(json.dumps(summary, indent=1), flush=True)


def score_snapshots(config, workdir: str, snapshots: list) -> list[tuple[int, float]]:
    """(step, held-out loss) of each snapshot (step, the global fragments); writes the run's records (config.json,
    data.json) into `workdir`."""
    from core.train.state import init_state
    from core.train.step import evaluate as evaluate_state
    from core.train.step import make_eval_step

    one = learner_config(config)
    corpus, batches = build.build_data(one)
    load.write_records(workdir, config, corpus)
    _, sharder = build.build_mesh(one)
    graphdef, state = init_state(build.build_model_fn(one, sharder), build.build_optimizer(one), 0, sharder)
    index = fragment_leaves(state.params, config.fomoe.fragments)
    step = make_eval_step(graphdef, byte_lengths=batches.tokenizer.byte_lengths, pad_id=batches.tokenizer.pad_id)
    val = [jax.numpy.asarray(b) for b in batches.val_batches(config.train.eval_batches)]
    out = []
    for s, fragments in snapshots:
        params = state.params
        for idx, values in zip(index, fragments):
            params = put_fragment(params, idx, values)
        out.append((s, evaluate_state(step, state._replace(params=params), val)["val_loss"]))
    return out


if __name__ == "__main__":
    command.run(main)
