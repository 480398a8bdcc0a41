"""Benchmarks, compared side by side in one run: each writes JSON and a markdown table into `--out` (runs/ by
default, results/ for the committed tables the docs quote)."""
