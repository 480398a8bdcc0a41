"""Writes docs/configuration.md, the reference of every config key, from the schema.

python -m experiments.config_doc
"""

import pathlib

from core import config as config_lib
from experiments import build

PATH = pathlib.Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def render() -> str:
    header = (
        "# Configuration reference\n\n"
        "Generated from the schema by `python -m experiments.config_doc`; do not edit by hand.\n"
        "Every key can be set in a config file (`experiments/configs/*.py`) or on the command line as\n"
        "`--config.<section>.<key>=<value>`. Unknown keys, wrong types and impossible values are rejected\n"
        "before anything compiles, with a message naming the key, the value and what is allowed.\n\n"
    )
    return header + config_lib.describe(build.schema())


if __name__ == "__main__":
    PATH.write_text(render())
    print(f"wrote {PATH}")
