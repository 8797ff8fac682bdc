"""Durations on the command line: '3600', '90s', '30m', '12h' or '7d'."""

from __future__ import annotations

import argparse

SECONDS_PER = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds in '3600', '90s', '30m', '12h' or '7d'."""
    unit = text[-1:].lower()
    number = text[:-1] if unit in SECONDS_PER else text
    try:
        seconds = float(number) * SECONDS_PER.get(unit, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r}") from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"a duration must be positive, got {text!r}")
    return seconds


def in_days(seconds: float) -> str:
    return f"{seconds / SECONDS_PER['d']:g}d"
