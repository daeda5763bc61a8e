"""A knob's condition (`when: "sharding_group_size > 0 and sparse_sync == weight_avg"`): where it
does not hold the knob takes its default, so configurations that differ only in a meaningless knob
are one."""

from __future__ import annotations

import dataclasses
import operator
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from cubic_harness.config import TrialConfig

if TYPE_CHECKING:
    from cubic.space.loader import Loader

OPS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
       ">=": operator.ge, "in": lambda a, b: a in b, "not in": lambda a, b: a not in b}
COND_RE = re.compile(r"^\s*(\w+)\s*(==|!=|<=|>=|<|>|not in|in)\s*(.+?)\s*$")
#: What a condition may name on either side: a knob or any other config field.
FIELDS = frozenset(f.name for f in dataclasses.fields(TrialConfig))


@dataclass(frozen=True)
class Cond:
    """`lhs op rhs`: lhs a knob/field name, rhs a literal (YAML scalar or list) or a field name."""

    lhs: str
    op: str
    rhs: Any
    rhs_is_field: bool

    def holds(self, values: dict[str, Any]) -> bool:
        rhs = values[self.rhs] if self.rhs_is_field else self.rhs
        try:
            return bool(OPS[self.op](values[self.lhs], rhs))
        except TypeError:
            return False

    def names(self) -> tuple[str, ...]:
        """The field names it reads."""
        return (self.lhs, self.rhs) if self.rhs_is_field else (self.lhs,)

    def __str__(self) -> str:
        return f"{self.lhs} {self.op} {self.rhs}"


def parse_conditions(ld: Loader, key: str, when: Any) -> tuple[Cond, ...]:
    """`when`'s conditions, joined with ' and ' ((): none); a part that does not parse is one line
    at `key`."""
    if when is None or when == "":
        return ()
    if not isinstance(when, str):
        raise ld.err(key, "must be a string like 'sharding_group_size < world_size' "
                     "(joined with ' and ')")
    out = []
    for part in re.split(r"\s+and\s+", when.strip()):
        m = COND_RE.match(part)
        if not m:
            raise ld.err(key, f"cannot parse '{part}'; write 'NAME OP VALUE' with OP in "
                         f"{list(OPS)}")
        lhs, op, rhs_s = m.groups()
        if rhs_s in FIELDS:
            out.append(Cond(lhs, op, rhs_s, True))
            continue
        try:
            rhs = yaml.safe_load(rhs_s)
        except yaml.YAMLError:
            raise ld.err(key, f"cannot parse the value in '{part}'") from None
        if isinstance(rhs, dict):
            raise ld.err(key, f"cannot parse the value in '{part}'")
        if op in ("in", "not in") and not isinstance(rhs, list):
            raise ld.err(key, f"'{part}': '{op}' needs a list like [a, b]")
        out.append(Cond(lhs, op, tuple(rhs) if isinstance(rhs, list) else rhs, False))
    return tuple(out)
