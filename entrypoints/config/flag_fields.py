"""Settings built from parsed flags by the config tree's rule: a field takes the flag of its
name (``--max-num-seqs`` -> ``max_num_seqs``), so a flag costs a field and its use."""

import argparse
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def from_flags(cls: type[T], args: argparse.Namespace, **computed: Any) -> T:
    """``cls`` (a dataclass) with each field from the flag of its name, except ``computed``
    ones (flags parsed or renamed on the way: split lists, hashed keys, defaults that depend
    on other settings). A field with neither is a wiring error, named."""
    values = dict(computed)
    for f in fields(cls):  # type: ignore[arg-type]
        if f.init and f.name not in values:
            if not hasattr(args, f.name):
                raise AttributeError(f"{cls.__name__}.{f.name}: no flag of that name")
            values[f.name] = getattr(args, f.name)
    return cls(**values)
