"""Model-level benchmarks (tzrec-gr modules on tzrec-ops backends)."""
