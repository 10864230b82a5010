"""The metadata service: node registry, chunk index, placement and lookup."""
