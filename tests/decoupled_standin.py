"""A stand-in Decoupled DiLoCo learner for tests: experiments.decoupled_learner's protocol with NumPy only. Its
fragments are two arrays of fixed shapes; every push sends a delta of ones x (learner + 1) and sleeps `--sleep`
seconds per round (the steps a real learner would train)."""

import argparse
import os
import sys
import time
from multiprocessing.connection import Client

import numpy as np

from experiments.decoupled_learner import AUTHKEY_ENV, recv_arrays, send_arrays

SHAPES: list[list[tuple[int, ...]]] = [[(3, 2)], [(5,)]]


def main() -> None:
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--learner", type=int)
    parser.add_argument("--address")
    parser.add_argument("--joining", action="store_true")
    own = parser.parse_args(sys.argv[1:split])
    steps, k = 8, 2
    for arg in sys.argv[split + 1 :]:
        if arg.startswith("--config.train.steps="):
            steps = int(arg.split("=")[1])
        if arg.startswith("--config.fomoe.local_steps="):
            k = int(arg.split("=")[1])
    host, port = own.address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
    initial = [[np.zeros(s, np.float32) for s in f] for f in SHAPES]
    conn.send(("hello", own.learner, {"shapes": SHAPES, "initial": initial}))
    _, start, versions = conn.recv()
    for f in SHAPES:
        recv_arrays(conn, f)
    for call in range(start + k, steps + 1, k):
        time.sleep(float(os.environ.get("STANDIN_SLEEP", "0.05")))
        p = (call // k - 1) % len(SHAPES)
        delta = [np.full(s, own.learner + 1.0, np.float32) for s in SHAPES[p]]
        header = dict(learner=own.learner, fragment=p, tokens=100, steps=k, base=versions[p], call=call, loss=0.0)
        send_arrays(conn, ("push", header), delta)
        _, _, versions[p] = conn.recv()
        recv_arrays(conn, SHAPES[p])
    conn.send(("done", own.learner))


if __name__ == "__main__":
    main()
