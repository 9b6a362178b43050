"""Errors raised by the runtime. This module owns the runtime's error classes; each
derives from `kvexport.errors.KvExportError` so callers can catch one base class.

NOTE: running out of KV blocks is not an error: the KV layers return ``None`` and the
scheduler preempts or waits. These classes are for calls made out of protocol.
"""

from __future__ import annotations

from kvexport.errors import KvExportError


class KVCacheError(KvExportError):
    """A KV-cache call broke the protocol: an unknown or already freed request id, a
    double free, a block id that is not held, a block reused with a different hash.
    The message names the request or block and the call that should have come first."""
