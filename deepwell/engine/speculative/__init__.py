"""Speculative decoding: drafters, confidence, the step-time curve, the verify-length planner
and lossless verification (spec/deepinfer.md §1.6)."""

from deepwell.engine.speculative.speculator import Speculator
from deepwell.engine.stats import SpecStats

__all__ = ["SpecStats", "Speculator"]
