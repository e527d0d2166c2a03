"""rgpu-admin: the operators' command line."""
