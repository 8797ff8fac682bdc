"""How a setting is declared: a dataclass field whose metadata carries its help, flag,
environment variable and the checks its value must pass (`setting`), and the checks run
over a whole dataclass of them (`check_settings`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from deepwell.settings import environment

# The --help sections the flags go in.
Group = Literal["model", "engine", "KV cache", "parallelism"]
# How a boolean's flag sets it: "--x" turns it on, "--no-x" off, or both spellings exist.
BoolFlag = Literal["on", "off", "both"]


@dataclass(frozen=True)
class Setting:
    help: str
    group: Group
    # The value when neither a flag nor the environment variable gives one.
    default: Any = None
    # The command-line spellings (the first is the one --help and errors name); () for a
    # setting only code sets.
    flags: tuple[str, ...] = ()
    # A DEEPWELL_* variable that sets the default.
    env: str | None = None
    choices: tuple[Any, ...] | None = None
    # "positive" (> 0) or "non-negative" (>= 0); None values pass.
    bound: Literal["positive", "non-negative"] | None = None
    # Reads a flag's text (argparse `type`); None: the field's own type.
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    bool_flag: BoolFlag | None = None
    # --help's words for the default, where its value says too little (None, a duration).
    default_text: str | None = None


def setting(
    default: Any,
    help: str,
    *,
    group: Group = "engine",
    flags: tuple[str, ...] | str = (),
    env: str | None = None,
    env_parse: Callable[[str], Any] | None = None,
    choices: tuple[Any, ...] | None = None,
    bound: Literal["positive", "non-negative"] | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    bool_flag: BoolFlag | None = None,
    default_text: str | None = None,
) -> Any:
    """A dataclass field for one setting. With `env`, the variable (registered here, read
    with `env_parse`) is the default when set, read each time the dataclass is built."""
    if isinstance(flags, str):
        flags = (flags,)
    metadata = {
        "setting": Setting(
            help=help,
            group=group,
            default=default,
            flags=flags,
            env=env,
            choices=choices,
            bound=bound,
            parse=parse,
            metavar=metavar,
            bool_flag=bool_flag,
            default_text=default_text,
        )
    }
    if env is not None:
        if env_parse is None:
            raise ValueError(f"{env} needs env_parse")
        environment.register(env, help, env_parse, default, default_text)

        def from_environment() -> Any:
            value = environment.read(env)
            return default if value is None else value

        return dataclasses.field(default_factory=from_environment, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def declared(cls: type) -> dict[str, Setting]:
    """The settings of a dataclass, by field name, in declaration order."""
    return {
        f.name: f.metadata["setting"] for f in dataclasses.fields(cls) if "setting" in f.metadata
    }


def check_settings(instance: Any) -> None:
    """Each setting's own checks (choices, bounds); the checks across settings stay with
    the dataclass."""
    for name, spec in declared(type(instance)).items():
        value = getattr(instance, name)
        if value is None:
            continue
        if spec.choices is not None and value not in spec.choices:
            raise ValueError(f"{name} must be one of {list(spec.choices)}, got {value!r}")
        if spec.bound == "positive" and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
        if spec.bound == "non-negative" and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
