"""QoS resource manager: pure allocation policy and its crash-safe state."""
