"""Byte sizes on the command line: 4096, 64K, 64KiB, 1M, 1.5G (binary units)."""

from __future__ import annotations

import math

import click

from kvblock.units import parse_size  # noqa: F401  (re-exported for the CLI)


class SizeType(click.ParamType):
    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


SIZE = SizeType()


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (nan passes every
    range check: it compares false both ways)."""

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        if not math.isfinite(value):
            self.fail(f"{value} is not a finite number", param, ctx)
        return value
