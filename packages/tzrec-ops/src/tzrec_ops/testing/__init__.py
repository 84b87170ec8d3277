"""Test helpers shared by every tzrec-ops backend: jagged input generators, hypothesis
strategies (:mod:`.generators`), per-dtype tolerances against the float64 oracle
(:mod:`.tolerances`) and the independent attention oracle (:mod:`.attention_oracle`).

hypothesis is needed only by the strategy functions; everything else needs torch alone.
"""
