"""docs/design.md's Layout section is true of the tree: it lists every module of the six packages, by its path from
the repository root, once, and every path it names exists.

A module is a `.py` file under core/, moe/, optim/, quant/, kvcache/ or experiments/. `__init__.py` files are
left out: they only re-export a package's public names, and the Layout says so instead of listing each one.
`__main__.py` files are commands (`python -m experiments.hf`), so they are listed like any module.
"""

import collections
import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("core", "moe", "optim", "quant", "kvcache", "experiments")
PATH = re.compile(r"`((?:core|moe|optim|quant|kvcache|experiments|tests|results|docs)/[\w./-]*)`")


def layout() -> str:
    """The text of docs/design.md's "## Layout" section."""
    text = (ROOT / "docs" / "design.md").read_text()
    start = text.index("\n## Layout\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def named_paths() -> list[str]:
    """Every repository path the Layout names in backticks, in order (repeats kept)."""
    return PATH.findall(layout())


def modules() -> set[str]:
    """Every module of the six packages, as a path from the repository root."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name != "__init__.py" and "__pycache__" not in path.parts:
                found.add(path.relative_to(ROOT).as_posix())
    return found


def test_every_module_is_in_the_layout():
    missing = sorted(modules() - set(named_paths()))
    assert not missing, f"modules docs/design.md's Layout does not list: {missing}"


def test_every_path_the_layout_names_exists():
    absent = sorted({p for p in named_paths() if not os.path.exists(ROOT / p)})
    assert not absent, f"paths docs/design.md's Layout names that do not exist: {absent}"


def test_every_module_is_listed_once():
    listed = collections.Counter(p for p in named_paths() if p.endswith(".py") and not p.startswith("tests/"))
    repeated = sorted(p for p, n in listed.items() if n > 1)
    assert not repeated, f"modules docs/design.md's Layout lists more than once: {repeated}"
