"""rgpu's Slurm integration: job_submit Lua, Slurm adapters, prolog logic, config snippets."""
