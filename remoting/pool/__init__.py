"""rgpu-poold: the pool daemon, its rules, placement, store, auth, and the one pool client."""
