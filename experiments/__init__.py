"""Composition of the packages: the CLI (run.py), the composition root (build.py), configs, benchmarks."""
