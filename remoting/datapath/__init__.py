"""The data path: the framed protocol, the per-session worker, the GPU backends."""
