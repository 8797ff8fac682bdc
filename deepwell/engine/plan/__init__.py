"""Memory planning from config.json alone: what a model's weights and KV take in memory, and
whether (and how many sequences) a machine holds. Torch-free, so `deepwell plan` is fast."""

from deepwell.engine.plan.footprint import KVFootprint, ModelFootprint, Weights, WeightShare
from deepwell.engine.plan.memory import MemoryPlan, plan_memory, read_footprint, refuse_unfit
from deepwell.engine.plan.sizes import parse_size

__all__ = [
    "KVFootprint",
    "MemoryPlan",
    "ModelFootprint",
    "WeightShare",
    "Weights",
    "parse_size",
    "plan_memory",
    "read_footprint",
    "refuse_unfit",
]
