"""EngineArgs: every knob of the engine in one typed place, declared torch-free in
`deepwell.settings.engine` (with its flags and environment variables) and used here."""

from deepwell.settings.engine import EngineArgs

__all__ = ["EngineArgs"]
