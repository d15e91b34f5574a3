"""One abstract contract suite per storage interface, run against every backend."""
