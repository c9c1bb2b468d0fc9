"""Run files: a command line's flags as a TOML file, read in front of the command line and written back.

``--config run.toml`` holds any of a CLI's long flags as settings (``tp = 2``,
``schedule = ["braided_v", "zb_v"]``, ``reference = true``; dashes or underscores). The
settings become flag tokens *in front of* the command line, so the command line overrides
the file and every value goes through the same parsing and checks as a typed flag.
:func:`dump_config` writes a run's effective configuration in the same form, so the file
a run leaves beside its checkpoint and metrics replays it.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, Sequence

from braid.io.inputs import InputFileError, read_text
from braid.io.limits import RUN_FILE


class ConfigError(ValueError):
    """A run file that cannot be used; the message is one line."""


def _toml_loads(text: str) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise ConfigError("--config needs Python 3.11+ (tomllib) or the tomli package: pip install tomli") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"not valid TOML: {err}") from None


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Long-flag actions by destination (help and --config left out)."""
    out = {}
    for action in parser._actions:  # argparse has no public list of its actions
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and action.dest not in ("help", "config"):
            out[action.dest] = action
    return out


def config_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` with the settings of its ``--config`` file (if any) turned into flags in front of it."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return list(argv)
    path = known.config
    try:
        data = _toml_loads(read_text(path, "run file", RUN_FILE))
    except InputFileError as err:  # missing, unreadable, binary, larger or deeper than a run file may be
        raise ConfigError(f"--config {err}") from None
    except ConfigError as err:
        raise ConfigError(f"--config {path}: {err}") from None
    return settings_argv(parser, data, source=f"--config {path}") + list(argv)


def settings_argv(parser: argparse.ArgumentParser, data: dict[str, Any], source: str = "--config") -> list[str]:
    """Flag tokens for a mapping of settings (raises :class:`ConfigError` on unknown names or wrong kinds)."""
    flags = _flags(parser)
    out: list[str] = []
    for key, value in data.items():
        dest = key.replace("-", "_")
        if dest == "config":
            raise ConfigError(f"{source}: a run file cannot name another run file (config = ...)")
        action = flags.get(dest)
        if action is None:
            raise ConfigError(f"{source}: unknown setting {key!r}; settings are the long flag names "
                              f"(e.g. {next(iter(flags), 'steps')} = ...)")
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if action.nargs == 0:  # store_true
            if not isinstance(value, bool):
                raise ConfigError(f"{source}: {key} takes true or false, got {value!r}")
            out += [flag] if value else []
        elif isinstance(value, list):
            if action.nargs not in ("+", "*") or not value:
                raise ConfigError(f"{source}: {key} takes one value, got a list")
            out += [flag, *(_token(key, v, source) for v in value)]
        else:
            out += [flag, _token(key, value, source)]
    return out


def _token(key: str, value: Any, source: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        shown = repr(value) if isinstance(value, (bool, type(None))) else f"a {type(value).__name__}"  # never a deep repr
        raise ConfigError(f"{source}: {key} = {shown} is not a number or a string")
    return repr(value) if isinstance(value, float) else str(value)


def dump_config(parser: argparse.ArgumentParser, args: argparse.Namespace, header: str = "") -> str:
    """The values of every flag in ``args`` as a run file (unset flags as comments)."""
    lines = [f"# {line}" for line in header.splitlines()]
    for dest, action in _flags(parser).items():
        value = getattr(args, dest, None)
        key = dest.replace("_", "-")
        if value is None or value is False and action.nargs == 0:
            lines.append(f"# {key} = (not set)")
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, float):
        if not math.isfinite(value):
            return {"inf": "inf", "-inf": "-inf"}.get(repr(value), "nan")
        return repr(value)
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))  # a JSON string with ASCII escapes is a TOML basic string
