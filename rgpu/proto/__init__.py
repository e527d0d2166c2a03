"""Generated gRPC code for rgpu.proto (regenerate with `python -m rgpu.proto.generate`)."""
