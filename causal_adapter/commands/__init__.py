"""Layer 8, the command line: one module per command on one shared parser helper."""
