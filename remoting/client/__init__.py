"""Client tools on CPU nodes: flexrun and smi."""
