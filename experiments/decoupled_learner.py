"""One Decoupled DiLoCo learner (a process of experiments.decoupled): single-site training of the full model on its
share of every global batch, with no collective, sending a fragment's pseudo-gradient to the synchroniser every
`fomoe.local_steps` steps and adopting the fragment it is sent back.

    python -m experiments.decoupled_learner --learner M --address HOST:PORT -- <experiments.run arguments>

The synchroniser's key is read from the environment (AUTHKEY_ENV). The messages (multiprocessing.connection,
framed):

  learner -> synchroniser   ("hello", learner, header)          header: the fragments' shapes and initial values
                            ("push", header) + the delta's bytes header: Contribution fields but the delta, call
                            ("done", learner)
  synchroniser -> learner   ("start", call, versions) + every fragment's bytes, on hello
                            ("fragment", p, version) + its bytes, after each push

Fragment values travel as raw float32 bytes (`send_arrays`), so the bytes on the wire are exactly 4 x the values
plus the small pickled headers.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from multiprocessing.connection import Client
from typing import Any

import numpy as np

__all__ = ["AUTHKEY_ENV", "fragment_leaves", "learner_config", "main", "put_fragment", "recv_arrays", "send_arrays"]

AUTHKEY_ENV = "DECOUPLED_AUTHKEY"


def send_arrays(conn, header: tuple, arrays: list[np.ndarray]) -> int:
    """Sends `header` (pickled) then the arrays' float32 bytes as one message; returns the arrays' bytes."""
    conn.send(header)
    data = b"".join(np.ascontiguousarray(a, np.float32).tobytes() for a in arrays)
    conn.send_bytes(data)
    return len(data)


def recv_arrays(conn, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """The float32 arrays of `shapes` from one message of `send_arrays`' bytes."""
    flat = np.frombuffer(conn.recv_bytes(), np.float32)
    sizes = [int(np.prod(s)) for s in shapes]
    if flat.size != sum(sizes):
        raise ValueError(f"received {flat.size} values for shapes {shapes} ({sum(sizes)} values).")
    return [c.reshape(s).copy() for c, s in zip(np.split(flat, np.cumsum(sizes)[:-1]), shapes)]


def fragment_leaves(params, count: int) -> list[list[int]]:
    """For each of moe.streaming's `count` fragments, the indices of its leaves in `jax.tree.leaves(params)`."""
    import jax

    from moe import streaming

    return [[i for i, m in enumerate(jax.tree.leaves(f)) if m] for f in streaming.fragments(params, count)]


def put_fragment(params, leaves: list[int], values: list[np.ndarray]):
    """`params` with the leaves at `leaves` (`fragment_leaves`' indices) set to `values`, each in its leaf's dtype
    and sharding."""
    import jax

    flat, treedef = jax.tree.flatten(params)
    for i, v in zip(leaves, values):
        flat[i] = jax.device_put(np.asarray(v, flat[i].dtype), flat[i].sharding)
    return jax.tree.unflatten(treedef, flat)


def learner_config(config):
    """A learner's config: the federation's model on one device (mesh.site = 1), all experts resident."""
    out = config.copy_and_resolve_references()
    out.mesh.site, out.mesh.data, out.mesh.num_processes = 1, 1, 1
    return out


def main(argv: list[str] | None = None) -> int:
    from experiments import args as args_lib  # here: the wire helpers above import nothing heavy

    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--learner", type=int, required=True)
    parser.add_argument("--address", required=True, help="HOST:PORT of the synchroniser")
    parser.add_argument("--joining", action="store_true", help="a restarted learner: its updates warm up")
    own = parser.parse_args(argv[:split])
    config, _ = args_lib.parse_run_args(["decoupled_learner", *argv[split + 1 :]])
    host, port = own.address.rsplit(":", 1)
    run(
        config,
        own.learner,
        own.joining,
        lambda: Client((host, int(port)), authkey=bytes.fromhex(os.environ[AUTHKEY_ENV])),
    )
    return 0


def run(config, learner: int, joining: bool, connect) -> None:
    """Trains learner `learner` of `config.mesh.site` against the synchroniser that `connect()` reaches (a
    connection) until train.steps. The step is compiled before the learner says hello, so that a learner that
    (re)joins trains from the step it is given at once. A `joining` learner starts with fresh inner optimizer state,
    so its updates ramp linearly up over its first fomoe.arrival_warmup steps (as an arrived expert's do,
    moe.reshuffle): Adam's first bias-corrected steps would otherwise move every value by the full learning rate."""
    import jax
    import jax.numpy as jnp
    import optax

    from core.data import Batches
    from core.train import make_train_step
    from core.train.state import init_state
    from core.train.step import lm_loss
    from experiments import build
    from experiments.hf import load as hf_load

    sites, k, count = config.mesh.site, config.fomoe.local_steps, config.fomoe.fragments
    one = learner_config(config)
    corpus, _ = build.build_data(one)
    batches = Batches(
        corpus, seq_len=one.data.seq_len, global_batch=one.data.batch_size, seed=one.data.seed,
        process_index=learner, process_count=sites,
    )  # fmt: skip
    _, sharder = build.build_mesh(one)
    optimizer = build.build_optimizer(one)
    if joining:
        warmup = one.fomoe.arrival_warmup
        optimizer = optax.chain(optimizer, optax.scale_by_schedule(lambda n: jnp.minimum(1.0, (n + 1) / warmup)))
    graphdef, state = init_state(
        build.build_model_fn(one, sharder), optimizer, one.train.seed, sharder, init_params=hf_load.init_params(one)
    )
    jitted = make_train_step(graphdef, optimizer, functools.partial(lm_loss, pad_id=batches.tokenizer.pad_id))
    step = jitted.lower(state, jnp.asarray(batches.train_batch(0))).compile()
    leaves = jax.tree.leaves(state.params)
    index = fragment_leaves(state.params, count)
    shapes = [[tuple(leaves[i].shape) for i in idx] for idx in index]
    host = [np.asarray(a, np.float32) for a in jax.device_get(leaves)]
    conn = connect()
    conn.send(("hello", learner, {"shapes": shapes, "initial": [[host[i] for i in idx] for idx in index]}))
    _, start, versions = conn.recv()
    base = [recv_arrays(conn, s) for s in shapes]
    params = state.params
    for p in range(count):
        params = put_fragment(params, index[p], base[p])
    state = state._replace(params=params, step=jnp.asarray(start, jnp.int32))
    tokens_per_step = batches.local_batch * one.data.seq_len
    for call in range(start, one.train.steps):
        state, metrics = step(state, jnp.asarray(batches.train_batch(call)))
        if (call + 1) % k:
            continue
        p = ((call + 1) // k - 1) % count
        flat = jax.device_get(jax.tree.leaves(state.params))
        delta = [b - np.asarray(flat[i], np.float32) for b, i in zip(base[p], index[p])]
        header: dict[str, Any] = dict(
            learner=learner, fragment=p, tokens=k * tokens_per_step, steps=k, base=versions[p]
        )
        send_arrays(conn, ("push", {**header, "call": call + 1, "loss": float(metrics["loss"])}), delta)
        _, _, versions[p] = conn.recv()
        base[p] = recv_arrays(conn, shapes[p])
        state = state._replace(params=put_fragment(state.params, index[p], base[p]))
    conn.send(("done", learner))
    conn.close()


if __name__ == "__main__":
    from experiments import command

    command.run(main)
