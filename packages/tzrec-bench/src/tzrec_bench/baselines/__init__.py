"""Baseline models trained in the same harness as the tzrec-gr models."""

from tzrec_bench.baselines.sasrec import SASRec

__all__ = ["SASRec"]
