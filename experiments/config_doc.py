"""Writes docs/configuration.md, the reference of every config key, from the schema; `text` renders the same
reference for a terminal (`python -m experiments.run --help`).

python -m experiments.config_doc
"""

import pathlib
import textwrap

from core import schema as core_schema
from experiments import optimizers, schema

PATH = pathlib.Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def family_table() -> str:
    """The optimizer families' defaults of optim.b1, b2, eps and momentum (from experiments.optimizers), as markdown."""
    keys = optimizers.FAMILY_KEYS
    lines = [
        "### Optimizer families: the defaults of `optim.b1`, `b2`, `eps` and `momentum`",
        "",
        "These keys default to None, meaning the family's value below; a value set in the config is used as given.",
        "A key a family does not use (-) must stay unset: setting it is an error.",
        "",
        "| family | `optim.name` | " + " | ".join(f"`{k}`" for k in keys) + " | source |",
        "|---|---|" + "---|" * len(keys) + "---|",
    ]
    for family in optimizers.FAMILIES:
        names = ", ".join(f"`{n}`" for n, o in optimizers.OPTIMIZERS.items() if o.family == family)
        cells = " | ".join(f"{family.defaults[k]:g}" if k in family.defaults else "-" for k in keys)
        lines.append(f"| {family.name} | {names} | {cells} | {family.source} |")
    return "\n".join(lines) + "\n\n"


def resume_rules() -> str:
    """Which keys a resume requires equal and which it lets change only when told to (the sections' `compat` and
    `provenance` declarations), as markdown."""
    fixed, trained = [], []
    for name, cls in schema.SECTIONS.items():
        compat = getattr(cls, "compat", False)
        fixed += [f"`{name}`"] if compat is True else [f"`{name}.{k}`" for k in compat or ()]
        keys = getattr(cls, "provenance", False)
        trained += (
            [f"the other `{name}` keys" if compat else f"`{name}`"]
            if keys is True
            else [f"`{name}.{k}`" for k in keys or ()]
        )
    return (
        "Resuming from a workdir's checkpoint requires " + ", ".join(fixed) + " and the corpus (its fingerprint)\n"
        "to be as they were. " + ", ".join(trained) + " describe how the weights were trained: a resume refuses a\n"
        "change of them unless `checkpoint.accept_changes=True`, which records the change in `history.jsonl`.\n"
        "Everything else (mesh, cadences, sampling) may differ between a run and its resume.\n\n"
    )


def render() -> str:
    header = (
        "# Configuration reference\n\n"
        "Generated from the schema by `python -m experiments.config_doc`; do not edit by hand.\n"
        "Every key can be set in a config file (`experiments/configs/*.py`) or on the command line as\n"
        "`--config.<section>.<key>=<value>`. Unknown keys, wrong types and impossible values are rejected\n"
        "before anything compiles, with a message naming the key, the value and what is allowed.\n\n"
    ) + resume_rules()
    body = core_schema.describe(schema.schema())
    # the families' table right after the optim section's table (before the next section's heading)
    start = body.index("## `optim`")
    end = body.find("\n## `", start + 1)
    end = len(body) if end < 0 else end + 1
    return header + body[:end] + family_table() + body[end:]


def section_summary(cls: type) -> str:
    """The first sentence of a section declaration's docstring, without its "The section `x`: " lead."""
    doc = " ".join((cls.__doc__ or "").split())
    _, colon, rest = doc.partition(": ")
    sentence = (rest if colon else doc).split(". ")[0].rstrip(".")
    return sentence


def text(width: int = 100) -> str:
    """Every config key of the schema as plain text (the reference of docs/configuration.md, for a terminal): per
    section, one entry per key, `section.key = default  [what is allowed]` followed by its one-line description,
    wrapped to `width` columns."""

    def wrap(line: str, first: int, rest: int) -> list[str]:
        return textwrap.wrap(
            line,
            width,
            initial_indent=" " * first,
            subsequent_indent=" " * rest,
            break_on_hyphens=False,
            break_long_words=False,
        )

    lines = []
    for section, fields in schema.schema().items():
        lines += ["", *wrap(f"{section}: {section_summary(schema.SECTIONS[section])}", 0, 4)]
        for key, f in fields.items():
            lines += wrap(f"{section}.{key} = {f.default!r}  [{f.describe()}]", 2, 8)
            lines += wrap(f.doc, 6, 6)
    return "\n".join(lines[1:]) + "\n"


if __name__ == "__main__":
    PATH.write_text(render())
    print(f"wrote {PATH}")
