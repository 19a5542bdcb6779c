"""Tidal's cluster scheduler (see service.py)."""
