"""Contracts between the node agent and the cluster side: what crosses the wire.

Both ``agent/`` and ``cluster/`` import this package; it imports neither (a
test reads the imports). It holds what must mean the same on both sides:

* ``errors``: the base of every expected failure (``TidalError``);
* ``states``: node lending states, the label and annotation that carry them,
  the extended resources of reclaimed capacity;
* ``pods``: a pod as a Tidal request (annotations, QoS, quantities);
* ``reports``: what the cluster knows of a node (zones, reclaimed capacity);
* ``nrt``: the NodeResourceTopology encoding and decoding;
* ``capacity``: the capacity in the shapes offline systems take.
"""
