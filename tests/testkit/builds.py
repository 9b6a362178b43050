"""What a build stores, read from its graphs (for tests comparing `kvexport plan` with a build)."""

from __future__ import annotations

from pathlib import Path


def stored_tensors(build_dir: Path) -> dict[int, int]:
    """offset -> length of every tensor the prefill and decode graphs keep in weights.data (a tensor both
    graphs use is stored once: one offset)."""
    import onnx

    from kvexport import io

    stored = {}
    for graph in (io.PREFILL_GRAPH, io.DECODE_GRAPH):
        for t in onnx.load(str(Path(build_dir) / graph), load_external_data=False).graph.initializer:
            where = {e.key: e.value for e in t.external_data}
            if where:
                stored[int(where["offset"])] = int(where["length"])
    return stored
