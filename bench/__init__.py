"""Benchmarks: run as `python -m bench.<name>`; figures go to bench/README.md."""
