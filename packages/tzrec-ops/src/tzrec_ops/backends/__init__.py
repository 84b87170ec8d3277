"""Built-in backends; each registers through tzrec-ops' own ``tzrec_ops`` entry points."""
