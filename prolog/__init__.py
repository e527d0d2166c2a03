"""rgpu's Slurm prologs and epilogs: the logic (logic.py), the entry points (main.py) and the scripts Slurm runs."""
