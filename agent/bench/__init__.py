"""Benchmarks behind ``tidal bench ...``: JSON out, comparisons side by side in one run."""
