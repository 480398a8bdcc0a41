"""Benchmarks: each writes JSON and a markdown table under results/bench/."""
