"""Speculative decoding: drafters, confidence, the step-time curve, the verify-length planner
and lossless verification (spec/deepinfer.md §1.6)."""

from deepwell.engine.speculative.speculator import SpecStats, Speculator

__all__ = ["SpecStats", "Speculator"]
