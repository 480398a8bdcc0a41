"""The torch comparison's process settings (experiments.bench.peer): the `--variants` grammar and its refusals,
which allocator and attention each variant's process is given, and the check that a preload took (a process
reports the allocator mapped into it)."""

import argparse
import os
import subprocess
import sys

import pytest

from experiments.bench import peer, peer_ours


def test_the_default_variants_cover_both_sides_and_every_allocator():
    chosen = peer.variants(peer.DEFAULT_VARIANTS)
    assert {v.side for v in chosen} == {"ours", "torch"}
    assert {v.allocator for v in chosen} == {"glibc", "jemalloc", "tcmalloc"}
    labels = {v.name: v.label() for v in chosen}
    assert labels["ours"] == "ours, library settings"
    assert labels["ours+glibc"] == "ours, glibc defaults"
    assert labels["torch"] == "torch sdpa"
    assert labels["torch+eager"] == "torch eager"
    assert labels["torch+tcmalloc+compile+fused"] == "torch sdpa + tcmalloc + compile + fused AdamW"
    assert len(set(labels.values())) == len(labels)
    assert ",".join(map(str, chosen)) == peer.DEFAULT_VARIANTS  # the table's command line gives them back


@pytest.mark.parametrize(
    "text, words",
    [
        ("ours,jax", ["'jax'", "allowed: ['ours', 'torch']"]),
        ("ours+compile,torch", ["'compile'", "allowed for ours"]),
        ("ours,torch+jemalloc+tcmalloc", ["more than one allocator"]),
        ("ours,torch+fused+fused", ["repeated"]),
        ("ours,torch,torch", ["named twice"]),
        ("ours+glibc", ["at least one variant of each side"]),
    ],
)
def test_a_bad_variant_is_refused_naming_it(text, words):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        peer.variants(text)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_preloaded_allocator_is_what_the_process_reports(tmp_path):
    """The check that stops a run whose preload did not take: a process started without LD_PRELOAD reports glibc,
    one started with jemalloc preloaded reports jemalloc."""
    code = "from experiments.bench import peer_ours; print(peer_ours.allocator())"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "glibc"
    found = peer.find_library(peer.ALLOCATORS["jemalloc"])
    if found is None:
        pytest.skip("no jemalloc here (Debian: libjemalloc2)")
    out = subprocess.run(
        [sys.executable, "-c", code], env={**env, "LD_PRELOAD": found}, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "jemalloc"


def test_our_process_refuses_a_token_batch_of_another_shape(tmp_path, capsys):
    import numpy as np

    path = tmp_path / "tokens.npy"
    np.save(path, np.zeros((2, 9), np.int32))
    with pytest.raises(SystemExit):
        peer_ours.main(["--model", "qwen3", "--size", "quickstart", "--tokens", str(path)])
    err = capsys.readouterr().err
    assert "--tokens" in err and "int32 (2, 9); allowed: int32 (8, 257)" in err, err
