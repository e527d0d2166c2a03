"""Prometheus exposition shared by rgpu-poold and rgpu-dispatcher: the HTTP endpoint and small
helpers for building metric families. What each daemon exports is built in its own component
(remoting/pool/metrics.py, remoting/dispatcher/metrics.py)."""
