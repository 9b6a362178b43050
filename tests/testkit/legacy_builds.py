"""Builds in the form kvexport wrote before a graph-contract addition, for "builds made before keep
working" tests: the real exporter with the addition switched off (the graphs are exactly what the
earlier version emitted; the manifest records their inputs as it always did)."""

from __future__ import annotations

from pathlib import Path


def build_without_logits_indices(source: str, out: Path, opts):
    """`kvexport build` as before io.LOGITS_INDICES: the paged prefill graph returns each
    sequence's last logits (every token's with all_logits). Returns build()'s result."""
    import dataclasses

    from kvexport.exporter import build as build_mod

    real = build_mod.GraphOptions

    def old_form(*args, **kw):
        return dataclasses.replace(real(*args, **kw), logits_indices=False)

    build_mod.GraphOptions = old_form
    try:
        return build_mod.build(source, out, opts)
    finally:
        build_mod.GraphOptions = real
