"""The command-line flags of the settings, generated from their declarations: `generate`,
`bench`, `serve` and `worker` all call `add_engine_arguments`, so they take the same engine
flags with the same help, and `engine_args_from` turns the parsed flags back into settings.

A setting with an environment variable gets the flag default None ("not given"), so that
EngineArgs reads the variable when it is built; the others show their default in the
namespace as in --help.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from deepwell.settings.declare import Group, Setting, declared
from deepwell.settings.engine import EngineArgs
from deepwell.settings.parallel import ParallelConfig


@dataclass(frozen=True)
class EngineGroups:
    """The `--help` sections the engine flags go in; commands add their own to them."""

    model: argparse._ArgumentGroup
    engine: argparse._ArgumentGroup
    cache: argparse._ArgumentGroup


def add_engine_arguments(parser: argparse.ArgumentParser) -> EngineGroups:
    """Every EngineArgs setting that has a flag, in three `--help` sections."""
    groups = EngineGroups(
        model=parser.add_argument_group("model"),
        engine=parser.add_argument_group("engine"),
        cache=parser.add_argument_group("KV cache"),
    )
    sections: dict[Group, argparse._ArgumentGroup] = {
        "model": groups.model,
        "engine": groups.engine,
        "KV cache": groups.cache,
    }
    _add_flags(EngineArgs, lambda spec: sections[spec.group])
    return groups


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """The ParallelConfig flags: DP size, expert parallelism, EPLB and the rendezvous."""
    section = parser.add_argument_group(
        "parallelism (torch.distributed; docs/parallel.md)",
        "attention data parallelism with MoE expert parallelism and EPLB; the ranks of this "
        "machine are started for you (`deepwell generate` also runs as one torchrun rank)",
    )
    _add_flags(ParallelConfig, lambda spec: section)


def engine_args_from(args: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """The EngineArgs the engine flags in `args` set; `overrides` (e.g. `parallel`) win."""
    return EngineArgs(**(given(args, EngineArgs) | overrides))


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The settings of `cls` whose flags `args` holds a value for."""
    return {
        name: getattr(args, name)
        for name, spec in declared(cls).items()
        if spec.flags and getattr(args, name, None) is not None
    }


def _add_flags(cls: type, section_of) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, spec in declared(cls).items():
        if spec.flags:
            _add_flag(section_of(spec), name, spec, fields[name])


def _add_flag(
    section: argparse._ArgumentGroup, name: str, spec: Setting, field: dataclasses.Field
) -> None:
    default = spec.default
    if spec.env is not None:
        # Not given: EngineArgs reads the variable, else its default.
        described = f"{spec.env} or {_describe(spec, default)}"
        default = None
    else:
        described = _describe(spec, default)
    help_text = f"{spec.help} (default: {described})".replace("%", "%%")
    if spec.bool_flag == "both":
        section.add_argument(
            *spec.flags,
            dest=name,
            action=argparse.BooleanOptionalAction,
            default=default,
            help=help_text,
        )
    elif spec.bool_flag is not None:
        section.add_argument(
            *spec.flags,
            dest=name,
            action="store_const",
            const=spec.bool_flag == "on",
            default=default,
            help=help_text,
        )
    else:
        section.add_argument(
            *spec.flags,
            dest=name,
            type=spec.parse or _type_of(field),
            choices=spec.choices,
            default=default,
            metavar=spec.metavar or spec.flags[0].removeprefix("--").upper().replace("-", "_"),
            help=help_text,
        )


def _describe(spec: Setting, default: Any) -> str:
    if spec.default_text is not None:
        return spec.default_text
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def _type_of(field: dataclasses.Field):
    """int, float or str, from the field's annotation (a string: postponed annotations)."""
    annotation = str(field.type)
    for kind in (int, float):
        if kind.__name__ in annotation.replace("|", " ").split():
            return kind
    return str
