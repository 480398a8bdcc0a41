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


# ------------------------------------------------------------------------------------------------ import direction

LIBRARIES = ("moe", "optim", "quant", "kvcache")
FLOORS = (
    ("experiments.command", "experiments.plotting", "experiments.cluster"),
    (
        "experiments.schema",
        "experiments.schema_moe",
        "experiments.schema_optim",
        "experiments.schema_quant",
        "experiments.schema_kvcache",
        "experiments.optimizers",
    ),
    ("experiments.configs", "experiments.config_doc", "experiments.build"),
    ("experiments.report",),
    ("experiments.hf",),
    ("experiments.federated",),
    ("experiments.load", "experiments.pretrained"),
    ("experiments.args",),
    ("experiments.engine", "experiments.server"),
    ("experiments.harness", "experiments.bench", "experiments.reproduce"),
)
"""experiments/'s floors below its commands, bottom first (docs/design.md, "the direction of imports"): a module imports
only modules of its own floor or of floors below. A name covers the module and, for a package, what is under it."""
COMMANDS = (
    "experiments.run",
    "experiments.serve",
    "experiments.server.cli",
    "experiments.launch",
    "experiments.elastic",
    "experiments.decoupled",
    "experiments.decoupled_learner",
    "experiments.tokenizer",
    "experiments.links",
    "experiments.hf.__main__",
)
"""The commands: no module imports one (tests may), except `serve` its `--http` half, `server.cli`, and
`decoupled` its learner's wire helpers."""
COMMAND_PARTS = {
    ("experiments.serve", "experiments.server.cli"),
    ("experiments.decoupled", "experiments.decoupled_learner"),
}


def module_files() -> dict[str, pathlib.Path]:
    """{dotted module name: file} of every module of the six packages (a package by its `__init__.py`)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """{module: {imported module of ours: the line of its first import}}, from every import statement anywhere in
    the file (module level, inside functions, under `if TYPE_CHECKING`); `from package import name` counts as an
    import of the submodule `package.name` where that is a module, else of the package."""
    import ast

    files = module_files()

    def ours(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in filter(None, map(ours, targets)):
                if target != module:
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def _within(module: str, name: str) -> bool:
    return module == name or module.startswith(name + ".")


def floor(module: str) -> int | None:
    """The index of `module`'s floor in FLOORS, len(FLOORS) for a command, None outside experiments/."""
    if not _within(module, "experiments"):
        return None
    if module in COMMANDS:
        return len(FLOORS)
    for i, names in enumerate(FLOORS):
        if any(_within(module, name) for name in names):
            return i
    return -1 if module == "experiments" else len(FLOORS) + 1  # a module no floor names: refused below


def against_direction(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import against docs/design.md's direction, as 'importer:line -> imported (why)'."""
    wrong = []
    for module, edges in sorted(graph.items()):
        top = module.split(".")[0]
        for target, line in sorted(edges.items()):
            arrow = f"{module}:{line} -> {target}"
            other = target.split(".")[0]
            if top == "core" and other != "core":
                wrong.append(f"{arrow} (core imports none of the others)")
            elif top in LIBRARIES and other not in ("core", top):
                wrong.append(f"{arrow} ({top} imports core only)")
            elif target in COMMANDS and (module, target) not in COMMAND_PARTS:
                wrong.append(f"{arrow} (a command is imported by nothing)")
            elif top == "experiments" and other == "experiments" and target not in COMMANDS:
                mine, theirs = floor(module), floor(target)
                assert mine is not None and theirs is not None
                if mine > len(FLOORS) or theirs > len(FLOORS):
                    wrong.append(f"{arrow} (a module on no floor: add it to FLOORS and docs/design.md)")
                elif theirs > mine:
                    wrong.append(f"{arrow} (climbs from floor {mine + 1} to floor {theirs + 1} of docs/design.md)")
    return wrong


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import cycles of `graph`: each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_goes_against_the_documented_direction():
    wrong = against_direction(import_graph())
    assert not wrong, "imports against docs/design.md's direction:\n" + "\n".join(wrong)


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, f"import cycles (function-level imports included): {found}"


def ml_collections_imports(package: str) -> list[str]:
    """`file:line` of every import of ml_collections (any form, anywhere in the file) in a package of ours."""
    import ast

    found = []
    for module, path in sorted(module_files().items()):
        if module.split(".")[0] != package:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "ml_collections"]
    return found


def test_the_libraries_never_import_ml_collections():
    """`moe`, `optim`, `quant` and `kvcache` take typed arguments of their own; the ConfigDict and its sections' checks
    are core's schema machinery and experiments/' (the scan sees core's own imports, so it is not vacuous)."""
    assert ml_collections_imports("core") and ml_collections_imports("experiments")
    found = {package: ml_collections_imports(package) for package in LIBRARIES}
    assert not any(found.values()), f"library files that import ml_collections: {found}"


def test_the_floors_are_the_documented_ones():
    """docs/design.md's section on the direction of imports names every floor and command the test checks."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## Packages, the composition root and the direction of imports") :]
    section = section[: section.index("\n## ")]
    named = [name for names in FLOORS for name in names] + list(COMMANDS)
    places = [section.find(f"`{name.removeprefix('experiments.').replace('.', '/')}") for name in named]
    missing = [name for name, at in zip(named, places, strict=True) if at < 0]
    assert not missing, f"floors or commands docs/design.md's direction of imports does not name: {missing}"
