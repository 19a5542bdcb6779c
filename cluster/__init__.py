"""Tidal's cluster-side modules (scheduler extender, lending controller, simulator)."""
