"""Module benchmarks: tzrec-gr modules (the STU stack, the ranking model) on tzrec-ops backends."""
