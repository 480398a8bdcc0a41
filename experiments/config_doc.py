"""Writes docs/configuration.md, the reference of every config key, from the schema.

python -m experiments.config_doc
"""

import pathlib

from core import config as config_lib
from experiments import build
from optim import config as optim_config

PATH = pathlib.Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def family_table() -> str:
    """The optimizer families' defaults of optim.b1, b2, eps and momentum (from optim.config), as markdown."""
    keys = ("b1", "b2", "eps", "momentum")
    lines = [
        "### Optimizer families: the defaults of `optim.b1`, `b2`, `eps` and `momentum`",
        "",
        "These keys default to None, meaning the family's value below; a value set in the config is used as given.",
        "A key a family does not use (-) must stay unset: setting it is an error.",
        "",
        "| family | `optim.name` | " + " | ".join(f"`{k}`" for k in keys) + " | source |",
        "|---|---|" + "---|" * len(keys) + "---|",
    ]
    for family, values in optim_config.FAMILY_DEFAULTS.items():
        names = ", ".join(f"`{n}`" for n, f in optim_config.FAMILIES.items() if f == family)
        cells = " | ".join(f"{values[k]:g}" if k in values else "-" for k in keys)
        lines.append(f"| {family} | {names} | {cells} | {optim_config.FAMILY_SOURCES[family]} |")
    return "\n".join(lines) + "\n\n"


def render() -> str:
    header = (
        "# Configuration reference\n\n"
        "Generated from the schema by `python -m experiments.config_doc`; do not edit by hand.\n"
        "Every key can be set in a config file (`experiments/configs/*.py`) or on the command line as\n"
        "`--config.<section>.<key>=<value>`. Unknown keys, wrong types and impossible values are rejected\n"
        "before anything compiles, with a message naming the key, the value and what is allowed.\n\n"
    )
    body = config_lib.describe(build.schema())
    # the families' table right after the optim section's table (before the next section's heading)
    start = body.index("## `optim`")
    end = body.find("\n## `", start + 1)
    end = len(body) if end < 0 else end + 1
    return header + body[:end] + family_table() + body[end:]


if __name__ == "__main__":
    PATH.write_text(render())
    print(f"wrote {PATH}")
