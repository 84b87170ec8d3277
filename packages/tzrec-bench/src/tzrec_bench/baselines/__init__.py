"""Baseline models trained (SASRec) or fitted from counts (the simple floors) in the same
harness as the tzrec-gr models."""

from tzrec_bench.baselines.sasrec import SASRec
from tzrec_bench.baselines.simple import ItemKNN, ItemTransitions, MostPopular, PopularityRanking

__all__ = ["ItemKNN", "ItemTransitions", "MostPopular", "PopularityRanking", "SASRec"]
