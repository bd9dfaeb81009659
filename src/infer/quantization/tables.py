"""Embedding tables and LM heads converted in place together with every module that shares
their weight (a tied LM head and its embedding read the same stored rows)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

# What a method's conversion sets on a table besides its parameters.
_ATTRIBUTES = ("quant_method", "dtype", "compute_dtype", "cols", "gguf_runs")


def convert_table(table: nn.Module, model: nn.Module, convert: Callable[[nn.Module], None]
                  ) -> None:
    """`convert(table)`, then every module of `model` that shares `table.weight` gets the
    same parameters and attributes."""
    ties = [m for m in model.modules()
            if m is not table and getattr(m, "weight", None) is table.weight]
    convert(table)
    for tied in ties:
        for name, param in table.named_parameters(recurse=False):
            setattr(tied, name, param)
        for name in _ATTRIBUTES:
            if hasattr(table, name):
                setattr(tied, name, getattr(table, name))
