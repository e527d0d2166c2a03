"""Jinja2 templates shipped with rgpu (adaptor.conf, Slurm snippets, unit files)."""
