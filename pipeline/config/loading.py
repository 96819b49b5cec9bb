"""Loading a run's config: a YAML file from `configs/` plus dotted `key=value` overrides, validated by the schema.

Every section forbids unknown keys, so a misspelled key fails loudly with its dotted name and the file it came from.
The schema's defaults *are* the embedded default job; `configs/default.yaml` spells them out for reading.
"""
from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pipeline.config.base import ConfigError, Section
from pipeline.config.run import DraftopsConfig
from pipeline.url_credentials import redact

REPO_CONFIGS = Path(__file__).resolve().parent.parent.parent / "configs"
DEFAULT_CONFIG_PATH = REPO_CONFIGS / "default.yaml"


class AliasRefused(yaml.YAMLError):
    """A YAML alias (`*name`) in a config: each one copies its anchor's value, so a few hundred bytes of nested
    aliases expand to gigabytes; a config has no need of them."""


class _NoAliasLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing every alias before it is expanded."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise AliasRefused(f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not accepted in "
                               "a config; write the value out")
        return super().compose_node(parent, index)


def safe_yaml(text: str) -> Any:
    """`yaml.safe_load` without aliases (AliasRefused, a yaml.YAMLError)."""
    return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"command line: {dotted}: '{key}' is a value, not a section")
        node = child
    node[leaf] = value


def _format_errors(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{origin}: unknown key '{key}'")
        else:
            lines.append(f"{origin}: {key}: {e['msg']} (got {e.get('input')!r})")
    return redact("\n".join(lines))


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """`a.b=1` pairs to a nested dict; values are parsed as YAML scalars (so 3 is an int, true a bool). A value YAML
    reads as an alias (`*...`: an override has no anchor to refer to) is the text itself, so that a crontab
    expression needs no quoting: `monitor.schedule=*/5 * * * *`."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"command line: override '{item}' is not of the form key=value")
        try:
            value = safe_yaml(raw) if raw.strip() else None
        except (yaml.YAMLError, RecursionError) as exc:
            if not raw.lstrip().startswith("*"):
                raise ConfigError(f"command line: {key.strip()}: not a YAML value: {str(exc).splitlines()[0]}"
                                  ) from None
            value = raw.strip()
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> DraftopsConfig:
    """Load a YAML config (default: configs/default.yaml if present) and apply dotted overrides."""
    path = Path(path) if path is not None else (DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.exists() else None)
    data: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        origin = str(path)
        if not path.exists():
            raise ConfigError(f"{path}: config file not found")
        try:
            data = safe_yaml(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not a text file (byte {exc.start} is not UTF-8)") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot be read: {exc.strerror or exc}") from None
        except AliasRefused as exc:
            raise ConfigError(f"{path}: {exc}") from None
        except (yaml.YAMLError, RecursionError) as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys")
    try:
        DraftopsConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, origin)) from None
    try:
        return DraftopsConfig.model_validate(_merge(data, parse_overrides(overrides)))
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, "command line")) from None


def validated_update(section: Section, update: dict[str, Any], prefix: str = "",
                     origin: str = "command line") -> Section:
    """`section` with `update` applied and validated by the schema, as a `key=value` override is: a command's own
    options (`draftops decode --temperature`) never bypass the config's checks. `prefix` names the section in errors
    (`decode.`)."""
    try:
        return type(section).model_validate({**section.model_dump(), **update})
    except ValidationError as exc:
        lines = []
        for e in exc.errors():
            key = prefix + ".".join(str(p) for p in e["loc"])
            lines.append(f"{origin}: {key}: {e['msg']} (got {e.get('input')!r})")
        raise ConfigError(redact("\n".join(lines))) from None


def save_config(cfg: DraftopsConfig, path: str | Path) -> Path:
    """Write the resolved config next to a run or checkpoint (nanoGPT habit: every artifact knows how it was made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


def _section(annotation) -> type[Section] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, Section) else None


def iter_fields(model: type[Section] = DraftopsConfig, prefix: str = ""):
    """(dotted key, pydantic field) for every leaf setting, in schema order; a list of sections (alert targets,
    engines) is followed by the fields of one item, as `key[].field`."""
    for name, field in model.model_fields.items():
        if _section(field.annotation):
            yield from iter_fields(field.annotation, f"{prefix}{name}.")
            continue
        yield f"{prefix}{name}", field
        if typing.get_origin(field.annotation) is list and _section(next(iter(typing.get_args(field.annotation)))):
            yield from iter_fields(typing.get_args(field.annotation)[0], f"{prefix}{name}[].")


def reference_markdown() -> str:
    """The config reference table of the README, generated from the schema so that the two cannot disagree."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key, field in iter_fields():
        meaning = (field.description or "").replace("|", "\\|").replace("\n", " ")
        if field.is_required():
            rows.append(f"| `{key}` | (required) | {meaning} |")
            continue
        default = field.get_default(call_default_factory=True)
        shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()
        rows.append(f"| `{key}` | `{shown}` | {meaning} |")
    return "\n".join(rows) + "\n"
