"""Benchmarks: one runner (``python -m benchmarks.run``), a registry of cases and providers
(``benchmarks.registry``, cases in ``bench_<backend>.py``), CSV results and plots under
``benchmarks/results/`` (``benchmarks.report``). See benchmarks/README.md."""
