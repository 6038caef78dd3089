"""Code the tests share, and share with the benchmarks (``bench/`` imports it as ``tests.support``)."""
