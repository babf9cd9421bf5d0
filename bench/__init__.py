"""Reef benchmarks: ``python -m bench <name>`` (see bench/README.md).

Each benchmark is one module with ``run(args) -> dict``; the runner prints a table and writes the
result to ``bench/results/<name>.json``.
"""
