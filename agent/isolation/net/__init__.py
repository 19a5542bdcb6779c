"""Network isolation: offline bulk traffic never inflates online latency.

``policy`` (what is asked, checked), ``netlink`` (pyroute2 session, nft runner),
``htb`` (the class tree, egress and IFB ingress), ``classify`` (nft: sockets of
the reclaimed tree are offline), ``routing`` (offline NIC by fwmark, with
fallback), ``shaper`` (set-up, live re-rating, status, revert).
"""
