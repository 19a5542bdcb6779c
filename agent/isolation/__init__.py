"""Isolation: the ONLY code that writes cgroups, tc, nft/iptables and routes."""
