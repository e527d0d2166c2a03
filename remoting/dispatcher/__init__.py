"""rgpu-dispatcher: registration with the pool, GPU inventory, the session server, MPS."""
