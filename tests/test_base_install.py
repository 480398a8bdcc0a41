"""The library works with the base install alone: `pip install -e .` without any extra.

Rather than build a fresh virtual environment (network, minutes), each check runs in a subprocess of this one
whose `sys.meta_path` refuses to import every module that only an extra provides: the import names of the
distributions pyproject.toml lists in `[project.optional-dependencies]`, minus every distribution the base
`dependencies` pull in, transitively, as installed here (absl-py comes with chex, scipy and ml-dtypes with jax,
prometheus-client with orbax-checkpoint: those stay importable, as they would after a base install). The list is
derived from pyproject.toml and the installed metadata, so it cannot drift from the extras.

In that process every module of `core`, `moe`, `optim`, `quant` and `kvcache` imports (a module that imports an
extra's package at module level fails the test, naming both), and the README's four library snippets run and
print their results. The same way, every module of `experiments` but the HTTP server's (`experiments/server/`, the
`[serve]` extra) imports with the `[experiments]` extra alone, which the README's quickstart command installs.
"""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from test_readme import library_snippets

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
LIBRARY = ("core", "moe", "optim", "quant", "kvcache")
SELF = "lowbit-moe-lab"


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def base_names() -> set[str]:
    return {normalize(Requirement(r).name) for r in project()["dependencies"]}


def extra_names() -> dict[str, set[str]]:
    """Each extra's own distributions (self-references such as `lowbit-moe-lab[experiments]` left out)."""
    extras = project()["optional-dependencies"]
    return {
        extra: {normalize(Requirement(r).name) for r in reqs if normalize(Requirement(r).name) != SELF}
        for extra, reqs in extras.items()
    }


def closure(names: set[str]) -> set[str]:
    """`names` and every distribution they require, transitively, as installed here (extras' requirements not
    followed)."""
    seen: set[str] = set()
    stack = list(names)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                stack.append(normalize(req.name))
    return seen


def refused_modules(allowed: tuple[str, ...] = ()) -> set[str]:
    """The top-level import names provided only by the distributions of extras other than `allowed`."""
    extras = extra_names()
    installed = closure(base_names() | set().union(*(extras[e] for e in allowed)))
    extra_only = set().union(*extras.values()) - installed
    provided: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            provided.setdefault(normalize(dist), set()).add(module)
    base_modules = set().union(*(provided.get(d, set()) for d in installed))
    missing = sorted(d for d in extra_only if d not in provided)
    assert not missing, f"extras' distributions not installed here (install '.[test]'): {missing}"
    return set().union(*(provided[d] for d in extra_only)) - base_modules


# Runs in the subprocess: argv[1] = JSON {"refused": [...], "packages": [...], "skip": [...], "snippets": [...]}:
# imports every module of the packages but those under a `skip` prefix, then runs the snippets.
CHILD = r"""
import importlib, importlib.abc, json, os, pkgutil, sys, traceback

spec = json.loads(sys.argv[1])
REFUSED = set(spec["refused"])
early = sorted(m for m in sys.modules if m.split(".")[0] in REFUSED)
assert not early, f"imported before the check started: {early}"


class RefuseExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in REFUSED:
            raise ModuleNotFoundError(f"No module named {name!r} (only an extra provides it)", name=name)
        return None


sys.meta_path.insert(0, RefuseExtras())
failures = []
skip = tuple(spec["skip"])
for package in spec["packages"]:
    modules = [package]
    try:
        pkg = importlib.import_module(package)
        found = pkgutil.walk_packages(pkg.__path__, package + ".")
        modules += [m.name for m in found if not m.name.startswith(skip)]
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in REFUSED:
            raise
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in REFUSED:
                raise
            ours = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith(os.getcwd() + os.sep)]
            where = f"{os.path.relpath(ours[-1].filename)}:{ours[-1].lineno}" if ours else module
            failures.append(f"{where} imports {e.name}")
if failures:
    sys.exit("modules that need a package the install lacks: " + "; ".join(sorted(set(failures))))
for i, snippet in enumerate(spec["snippets"]):
    exec(compile(snippet, f"README.md snippet {i}", "exec"), {"__name__": "readme_snippet"})
print("base install ok")
"""


def run_child(
    snippets: list[str], packages: tuple[str, ...] = LIBRARY, extras: tuple[str, ...] = (), skip: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    refused = sorted(refused_modules(extras))
    spec = {"refused": refused, "packages": list(packages), "skip": list(skip), "snippets": snippets}
    argv = [sys.executable, "-c", CHILD, json.dumps(spec)]
    return subprocess.run(argv, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_refused_modules_are_the_extras_own():
    """The derivation finds the extras' packages (and nothing the base install brings)."""
    refused = refused_modules()
    expected = {"fastapi", "uvicorn", "pydantic", "jinja2", "matplotlib", "tqdm", "tensorboardX", "tokenizers"}
    assert expected | {"safetensors", "openai"} <= refused, sorted(refused)
    assert not {"jax", "flax", "optax", "numpy", "chex", "ml_collections", "orbax", "ml_dtypes"} & refused


def test_the_base_dependencies_hold_no_extra_only_package():
    base = base_names()
    for extra, names in extra_names().items():
        assert not base & names, f"[{extra}] lists base dependencies: {sorted(base & names)}"
    references = [r for reqs in project()["optional-dependencies"].values() for r in reqs]
    for line in references:
        req = Requirement(line)
        if normalize(req.name) == SELF:
            assert req.extras <= set(project()["optional-dependencies"]), line


def test_the_library_packages_import_and_the_readme_snippets_run_without_any_extra():
    """Every module of the five library packages imports, then the README's four snippets run, in one process."""
    snippets = library_snippets()
    assert len(snippets) == 4
    result = run_child(snippets)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MGUP-AdamW: loss" in result.stdout and "fp4:" in result.stdout and "step 100:" in result.stdout
    assert "experts of token 0:" in result.stdout


def test_the_commands_import_with_the_experiments_extra_alone():
    """`experiments` without its HTTP server needs only `[experiments]` (the serve and test extras refused)."""
    assert "fastapi" in refused_modules(("experiments",)) and "matplotlib" not in refused_modules(("experiments",))
    result = run_child([], packages=("experiments",), extras=("experiments",), skip=("experiments.server",))
    assert result.returncode == 0, result.stderr[-3000:]
