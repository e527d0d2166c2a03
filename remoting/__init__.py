"""rgpu remoting: pool daemon, GPU-node dispatcher, data path, client shim, flexrun."""
