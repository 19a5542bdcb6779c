"""Small helpers both sides use (percentiles and timing of benchmarks). Imports neither side."""
