"""A tzrec-ops backend, ``compiled``: HSTU attention and layer norm written for
``torch.compile`` (Inductor), registered through the ``tzrec_ops`` entry point."""

__version__ = "1.0.0"
