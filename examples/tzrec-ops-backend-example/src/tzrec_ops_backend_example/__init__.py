"""An example tzrec-ops backend: ``addmm`` in plain torch, registered as backend ``example``."""

__version__ = "0.1.0"
