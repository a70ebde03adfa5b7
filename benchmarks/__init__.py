"""Benchmarks (not tests): side-by-side measurements in one run, printed as ratios."""
