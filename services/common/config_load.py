"""Loading the run configuration: defaults < config file (YAML/JSON/TOML) < environment
(`ASYNCRL_<NAME>`) < command line, into a validated RunConfig (services.common.config), and the
argparse flags, one group per section."""

from __future__ import annotations

import argparse
import json
import os
import types
import typing
from pathlib import Path

from pydantic import ValidationError

from services.common.config import SECTIONS, ConfigError, RunConfig
from services.common.config.run import FLAG_OF, FLAGS

ENV_PREFIX = "ASYNCRL_"


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _field_kind(annotation) -> tuple[type, bool, tuple | None]:
    """A field annotation's type (bool / int / float / str; a list's: int / str), whether it is a
    list, and its Literal choices if any."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _field_kind(next(a for a in args if a is not type(None)))
    if origin is typing.Literal:
        return str, False, tuple(args)
    if origin is list:
        return (int if args and args[0] is int else str), True, None
    return (annotation if annotation in (bool, int, float) else str), False, None


_BOOLS = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off"), False)


def _parse_scalar(tp: type, text: str):
    if text.lower() in ("none", "null") and tp is not str:
        return None
    if tp is not bool:
        return tp(text)
    if text.lower() not in _BOOLS:
        raise ValueError(f"not a boolean: {text!r}")
    return _BOOLS[text.lower()]


PASSTHROUGH = {"--eval-sglang-": "eval_sglang_args", "--no-eval-sglang-": "eval_sglang_args",
               "--sglang-": "sglang_server_args", "--router-": "sglang_router_args"}  # fmt: skip


def split_passthrough(argv: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Take every --sglang-<flag> / --router-<flag> (and its value, if any) that is not one of
    our own flags out of argv, renamed to the flag the SGLang server / router knows."""
    own = {flag_name(f) for f in FLAGS}
    rest: list[str] = []
    found: dict[str, list[str]] = {field: [] for field in PASSTHROUGH.values()}
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        flag = arg.split("=", 1)[0]
        prefix = next((p for p in PASSTHROUGH if flag.startswith(p)), None)
        if prefix is None or flag in own or flag.replace("--no-", "--") in own:
            rest.append(arg)
        elif prefix.startswith("--no-"):  # a boolean turned off: recorded as --no-<flag>, no value
            found[PASSTHROUGH[prefix]].append("--no-" + arg[len(prefix) :])
        else:
            found[PASSTHROUGH[prefix]].append("--" + arg[len(prefix) :])
            if "=" not in arg and i < len(argv) and not argv[i].startswith("--"):
                found[PASSTHROUGH[prefix]].append(argv[i])
                i += 1
    return rest, found


def add_config_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One argument per RunConfig field, in Miles's kebab-case names, under one help heading per
    configuration section. Defaults are suppressed so that only flags the user gave override the
    file and the environment. Descriptions are shown as written (argparse would read a `%` in
    them as a format directive)."""
    groups = {}
    for section in SECTIONS:
        title = section.__name__.removesuffix("Section").lower().replace("multilora", "multi-LoRA")
        groups[section] = parser.add_argument_group(f"{title} flags", (section.__doc__ or "").strip())
    for name, flag in FLAGS.items():
        if name in skip:
            continue
        info, group = flag.section.model_fields[flag.field], groups[flag.section]
        tp, is_list, choices = _field_kind(info.annotation)
        kw: dict = {"dest": name, "default": argparse.SUPPRESS, "help": (info.description or "").replace("%", "%%")}
        if tp is bool:
            group.add_argument(flag_name(name), action=argparse.BooleanOptionalAction, **kw)
        elif is_list:
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            action = "extend" if extra.get("repeatable") else "store"  # repeatable: every use adds its values
            group.add_argument(flag_name(name), nargs="*", type=tp, metavar="X", action=action, **kw)
        else:
            group.add_argument(
                flag_name(name),
                type=lambda t, k=tp: _parse_scalar(k, t),
                choices=choices,
                metavar=("{" + ",".join(choices) + "}") if choices else tp.__name__.upper(),
                **kw,
            )


def read_config_file(path: str | Path) -> dict:
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    elif path.suffix == ".toml":
        import tomllib

        data = tomllib.loads(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must hold a mapping of flag names to values")
    return {k.replace("-", "_"): v for k, v in data.items()}


def env_overrides(environ: dict[str, str]) -> dict:
    out = {}
    for name, flag in FLAGS.items():
        if (text := environ.get(ENV_PREFIX + name.upper())) is not None:
            tp, is_list, _ = _field_kind(flag.section.model_fields[flag.field].annotation)
            out[name] = [_parse_scalar(tp, t) for t in text.split()] if is_list else _parse_scalar(tp, text)
    return out


def resolve_config(cli: dict, config_file: str | None = None, environ: dict[str, str] | None = None) -> RunConfig:
    """Merge the sources in precedence order and validate once."""
    merged = read_config_file(config_file) if config_file else {}
    merged |= env_overrides(environ if environ is not None else dict(os.environ)) | cli
    if unknown := sorted(set(merged) - set(FLAGS)):
        names = ", ".join(flag_name(u) for u in unknown)
        raise ConfigError(f"unknown settings: {names} (see `asyncrl train-async --help` for the flags)")
    try:
        return RunConfig(**merged)
    except ValidationError as e:
        raise ConfigError(_pretty(e)) from None


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _pretty(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        where = tuple(str(x) for x in err["loc"])
        loc = FLAG_OF.get(where[:2], ".".join(where))  # (section, field) -> the flag
        flag = flag_name(loc) if loc else ""
        got = err.get("input")
        if err["type"] in _BOUNDS:
            bound = next(iter(err["ctx"].values()))
            msg = f"must be {_BOUNDS[err['type']]} {bound} (got {got})"
            field = FLAGS[loc].section.model_fields[FLAGS[loc].field] if loc in FLAGS else None
            if field is not None and isinstance(field.json_schema_extra, dict) and "hint" in field.json_schema_extra:
                msg += f"; {field.json_schema_extra['hint']}"
        elif err["type"] == "finite_number":
            msg = f"must be a finite number (got {got})"
        else:
            msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{flag} {msg}" if flag and err["type"] in (*_BOUNDS, "finite_number") else
                     f"{flag}: {msg}" if flag else msg)  # fmt: skip
    return "\n".join(lines)
