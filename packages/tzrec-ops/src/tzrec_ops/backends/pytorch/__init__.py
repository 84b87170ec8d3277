"""The ``pytorch`` reference backend: plain, traceable torch code; the numerical oracle."""
