"""The one check of every config, quantlab's and a plugin's: a field declares
its valid values in its ``metadata`` (``choices``, ``min``, ``max``,
``above``, ``rule``), a ``check(path)`` method holds the rules across
fields, and :func:`validate` runs both; :func:`check_choice` is the same
refusal for code given a raw value. Standard library only."""
from __future__ import annotations

import dataclasses
from typing import Any


def validate(cfg: Any, path: str = "") -> None:
    """The one check of every config, quantlab's and a plugin's: each field
    against the rules its ``metadata`` declares (``choices``; ``min``,
    ``max``, ``above`` for numbers; ``rule``: ``(predicate, description)``;
    ``note``: said after the valid range; a list's rules hold for each
    element), nested configs under ``path.``, then the config's own
    ``check(path)`` for rules across fields. Raises ``ValueError`` with one
    line naming the field, its value and what would be valid: as
    ``path.field=value: ...`` for a node of the run config, as
    ``<LABEL> field value; valid: ...`` for a config that declares a
    ``LABEL`` (schemes, which check themselves when constructed)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            validate(value, f"{path}{f.name}.")
            continue
        for v in (value if isinstance(value, list) else [value]):
            if (valid := _outside(f.metadata, v)) is None:
                continue
            if label := getattr(type(cfg), "LABEL", ""):
                raise ValueError(f"{label} {f.name} {v!r}; valid: {valid}")
            if "choices" in f.metadata:
                check_choice(f"{path}{f.name}", v, f.metadata["choices"], element=isinstance(value, list))
            raise ValueError(f"{path}{f.name}={value}: must be {valid}")
    if (check := getattr(cfg, "check", None)) is not None:
        check(path)


def _outside(rules: Any, v: Any) -> str | None:
    """The valid values ``v`` falls outside of, in words, or None when it is
    valid (None is: an optional field left unset)."""
    if v is None:
        return None
    note = f" ({rules['note']})" if "note" in rules else ""
    if "choices" in rules and v not in rules["choices"]:
        return ", ".join(map(str, rules["choices"])) + note
    if isinstance(v, (int, float)):
        lo, hi = rules.get("min"), rules.get("max")
        if lo is not None and hi is not None and not lo <= v <= hi:
            return f"{lo}..{hi}{note}"
        if lo is not None and v < lo:
            return f">= {lo}{note}"
        if "above" in rules and v <= rules["above"]:
            return f"> {rules['above']}{note}"
    if "rule" in rules and not rules["rule"][0](v):
        return rules["rule"][1] + note
    return None


def choices(config_type: type, name: str) -> tuple[str, ...]:
    """The values field ``name`` of ``config_type`` declares (``metadata["choices"]``)."""
    return next(f.metadata["choices"] for f in dataclasses.fields(config_type) if f.name == name)


def check_choice(name: str, value: Any, valid: tuple[str, ...], element: bool = False) -> None:
    """The one check of a string choice: ``ValueError`` naming the field, the
    value and the valid ones (``element``: ``value`` is one item of a list field)."""
    if value in valid:
        return
    if element:
        raise ValueError(f"{name}: unknown {value!r}; valid: {', '.join(valid)}")
    raise ValueError(f"{name}={value!r}: valid: {', '.join(valid)}")
