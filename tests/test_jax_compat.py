"""core.jax_compat against the installed JAX: every private symbol the project uses is there, a missing one is named
with the installed versions, and no other module of ours touches JAX's private internals."""

import ast
import pathlib

import pytest

from core import jax_compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRIVATE_PREFIXES = ("jax._src", "jaxlib._jax", "jaxlib.xla_extension")


@pytest.mark.parametrize("symbol", jax_compat.PRIVATE_SYMBOLS, ids=str)
def test_the_installed_jax_has_every_private_symbol_we_use(symbol):
    try:
        jax_compat.resolve(symbol)
    except jax_compat.JaxCompatError as e:
        pytest.fail(f"the installed JAX lacks `{symbol}`: {e}")


def test_a_missing_symbol_is_named_with_its_use_and_the_installed_versions():
    for missing in (
        jax_compat.Symbol("jax._src.clusters", "ClusterEnv.no_such_method", "a test"),
        jax_compat.Symbol("jax._src.no_such_module", "anything", "a test"),
    ):
        with pytest.raises(jax_compat.JaxCompatError) as e:
            jax_compat.resolve(missing)
        for needle in (str(missing), "a test", "jax 0.", "jaxlib 0.", "core/jax_compat.py"):
            assert needle in str(e.value), str(e.value)


def test_lookup_refuses_a_symbol_the_list_lacks():
    with pytest.raises(AssertionError, match="PRIVATE_SYMBOLS"):
        jax_compat.lookup("jax._src.clusters.ClusterEnv.not_listed")


def _private_imports(path: pathlib.Path) -> list[str]:
    """The private JAX modules `path` imports (import statements and importlib.import_module("...") strings)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith(PRIVATE_PREFIXES)]
    return found


def test_no_other_module_imports_private_jax_internals():
    compat = ROOT / "core" / "jax_compat.py"
    packages = ("core", "moe", "optim", "quant", "kvcache", "experiments")
    files = [p for pkg in packages for p in (ROOT / pkg).rglob("*.py")]
    offenders = [hit for p in files if p != compat for hit in _private_imports(p)]
    assert not offenders, f"private JAX internals outside core/jax_compat.py (move them there): {offenders}"
