"""Paper reproductions: each trains or measures what a paper claims and writes JSON, a markdown table and plots
into `--out` (runs/ by default, results/ for the committed ones the docs quote)."""
