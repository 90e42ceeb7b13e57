"""Benchmarks: run each from the repository root as `python -m bench.<name>`, so `bench` imports as a package."""
