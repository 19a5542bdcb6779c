"""Reporting: usage sampling, headroom (reclaimed capacity) and reports."""
