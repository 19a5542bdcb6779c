"""What the agent and the cluster side both use to talk to a Kubernetes API server: timeouts, the
NodeResourceTopology CRD check, list-then-watch. Imports neither side."""
