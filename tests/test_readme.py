"""The README's "Use it as a library" snippets run as written and do what their text says; docs/cli.md's sharding
example is a valid run.

Each ```python block of that section is executed on its own, in a fresh namespace (the snippets are complete
scripts), and the property it demonstrates is checked from the names it leaves behind against an independent
reference (a loss at the start, exact float32 attention, a dense float64 MoE).
"""

import contextlib
import io
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import schema
from experiments.args import parse_run_args
from experiments.hf import load as hf_load

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
CLI_DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "cli.md")
SECTION = "## Use it as a library"


def library_snippets() -> list[str]:
    """The python code blocks of the README's library section, in order."""
    with open(README) as f:
        text = f.read()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return re.findall(r"```python\n(.*?)```", text[start : end if end >= 0 else None], re.S)


def run(snippet: str) -> tuple[dict, str]:
    namespace: dict = {"__name__": "readme_snippet"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "README.md", "exec"), namespace)
    return namespace, out.getvalue()


def check_optax(ns: dict, printed: str) -> None:
    """MGUP-AdamW in an optax chain solves the least-squares problem it is given."""
    start = float(ns["loss"]({"w": jnp.zeros(16)}))
    assert float(ns["loss"](ns["params"])) < 1e-6 * start


def check_flax(ns: dict, printed: str) -> None:
    """The NNX MLP's loss falls under UFP4 GEMMs with fresh stochastic rounding per step."""
    losses = ns["losses"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]


def check_kvcache(ns: dict, printed: str) -> None:
    """Its exact attention equals a float64 one; the last format's (fp4) output is as far from it as printed; the
    printed errors grow as the bytes shrink, and fp4's is within what results/kvcache/quality.md measures
    (0.15-0.19)."""
    k, v, q = (np.asarray(a, np.float64) for a in (ns["k"], ns["v"], ns["q"][0]))
    s = np.einsum("hd,thd->ht", q, np.repeat(k, 2, axis=1)) / 8.0
    p = np.exp(s - s.max(-1, keepdims=True))
    exact = np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), np.repeat(v, 2, axis=1))
    np.testing.assert_allclose(np.asarray(ns["exact"]), exact, rtol=1e-4, atol=1e-5)
    errors = {m[0]: float(m[1]) for m in re.findall(r"^(\w+): .*relative error ([\d.]+)$", printed, re.M)}
    fp4 = np.linalg.norm(np.asarray(ns["out"][0]) - exact) / np.linalg.norm(exact)
    assert abs(errors["fp4"] - fp4) < 1e-3, (errors, fp4)
    assert errors["bf16"] < 0.01 < errors["fp8"] < 0.1 < errors["fp4"] < 0.25, errors


def check_moe(ns: dict, printed: str) -> None:
    """The MoE layer in a user's own NNX block equals a dense float64 computation of the same routing: RMSNorm, the
    softmax over the 8 experts' router logits, the top 2 of them, and x + sum_e p_e silu(h @ up_e) @ down_e over the
    chosen e (gates not renormalised); the printed experts are token 0's top 2."""
    block, x = ns["block"], np.asarray(ns["x"], np.float64).reshape(-1, 32)
    h = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * np.asarray(block.norm.scale.get_value(), np.float64)
    router, up, down = (np.asarray(p.get_value(), np.float64) for p in (block.ffn.router, block.ffn.up, block.ffn.down))
    logits = h @ router
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1)[:, :2]
    y = x.copy()
    for e in range(8):
        a = h @ up[e]
        y += np.where(top == e, p[:, e : e + 1], 0.0).sum(-1, keepdims=True) * ((a / (1 + np.exp(-a))) @ down[e])
    np.testing.assert_allclose(np.asarray(ns["y"], np.float64).reshape(-1, 32), y, rtol=1e-5, atol=1e-6)
    assert (y - x).std() > 1e-4  # the MoE's output is not negligible against the tolerance
    assert f"experts of token 0: {top[0].tolist()}" in printed, printed


CHECKS = {
    "mgup_adamw": check_optax,
    "nnx.Linear": check_flax,
    "decode_attention": check_kvcache,
    "MoEConfig": check_moe,
}


def test_the_section_has_one_snippet_per_package():
    snippets = library_snippets()
    assert [next(k for k in CHECKS if k in s) for s in snippets] == list(CHECKS)


@pytest.mark.parametrize("index", range(len(CHECKS)))
def test_snippet(index):
    snippet = library_snippets()[index]
    namespace, printed = run(snippet)
    assert printed.strip(), "a snippet shows its result"
    CHECKS[next(k for k in CHECKS if k in snippet)](namespace, printed)


def sharding_examples() -> list[list[str]]:
    """The argv of each `python -m experiments.run` command docs/cli.md's "Sharding" bullet shows: the code block,
    and the expert-parallel flags given in its text (on the same config and workdir)."""
    with open(CLI_DOC) as f:
        text = f.read()
    bullet = text[text.index("* Sharding:") :]
    bullet = bullet[: bullet.index("\n* ")]
    code = re.search(r"```\n(.*?)```", bullet, re.S)
    expert = re.search(r"`(--config\.mesh\.site=1 --config\.mesh\.data=2 --config\.mesh\.expert=4)`", bullet)
    assert code and expert, bullet
    block = code[1].replace("\\\n", " ").split()
    assert block[:3] == ["python", "-m", "experiments.run"], block
    base = block[3:7]  # --config FILE --workdir DIR
    return [["run", *block[3:]], ["run", *base, *expert[1].split()]]


@pytest.mark.parametrize("index", [0, 1], ids=["data_x_tensor", "data_x_expert"])
def test_the_sharding_example_is_a_valid_run_on_8_devices(index, monkeypatch):
    """The command is parsed as the CLI parses it and validated for the 8 devices it says, as the run would before
    compiling (training it takes minutes: docs/cli.md quotes what 10 steps of each measured)."""
    monkeypatch.chdir(os.path.join(os.path.dirname(__file__), os.pardir))
    config, _ = parse_run_args(sharding_examples()[index])
    hf_load.resolve(config)
    schema.validate(config, num_devices=8)
    mesh = config.mesh
    assert (mesh.site, mesh.data, mesh.model * mesh.expert) == (1, 2, 4)
