"""Tidal's node agent: discovery, QoS resource manager, isolation and reporting."""
