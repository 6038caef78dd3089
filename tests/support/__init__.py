"""Harnesses the tests share with the benchmarks (``bench/`` imports them from here)."""
