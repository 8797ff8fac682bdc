"""The registry of deepwell's environment variables: each DEEPWELL_* name, what it sets and
how its text is read. Every read goes through `read`, so an unregistered name is an error
and `docs` can list them all from here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    name: str
    # What it sets (a setting's name, or a sentence).
    sets: str
    # The value of a set, non-empty text; raises ValueError naming the variable.
    parse: Callable[[str], Any]


_REGISTRY: dict[str, EnvVar] = {}


def register(name: str, sets: str, parse: Callable[[str], Any]) -> str:
    """Declare a variable once; returns its name, for the declaration that uses it."""
    if not name.startswith("DEEPWELL_"):
        raise ValueError(f"deepwell's environment variables start with DEEPWELL_, got {name}")
    if name in _REGISTRY:
        raise ValueError(f"{name} is declared twice ({_REGISTRY[name].sets} and {sets})")
    _REGISTRY[name] = EnvVar(name, sets, parse)
    return name


def registered() -> dict[str, EnvVar]:
    return dict(_REGISTRY)


def read(name: str, environ: Mapping[str, str] = os.environ) -> Any | None:
    """The variable's parsed value; None when it is unset or empty."""
    variable = _REGISTRY[name]
    text = environ.get(name, "")
    if not text:
        return None
    try:
        return variable.parse(text)
    except ValueError as error:
        raise ValueError(f"{name} {error}") from None


# --- how their text is read ---


def parse_flag(text: str) -> bool:
    """DeepInfer's reading of a switch: on unless "0", "false" or "False"."""
    return text not in ("0", "false", "False")


def parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"must be an integer, got {text!r}") from None


def parse_floats(text: str) -> tuple[float, ...]:
    """A float or a comma-separated list of floats (DeepInfer's per-position switches)."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"must be a float or a comma list of floats, got {text!r}") from None


def parse_text(text: str) -> str:
    return text
