"""The build manifest (`kvexport.json`): the schema every part reads. The exporter writes
it last, so a directory with a valid manifest is a complete build; everything downstream
loads it through `load()` and never guesses."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import __version__, io
from .errors import ManifestError


@dataclass(frozen=True, slots=True)
class KVSpec:
    layout: str  # io.KVLayout value
    attention: str  # io.Attention value
    dtype: str  # io.DType value of the cache
    block_size: int  # tokens per block (paged); 0 for contiguous
    num_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_token: int  # io.kv_bytes_per_token(...)
    max_seq_len: int  # longest context (prompt + output) the build serves, tokens
    quantization: dict | None = None  # int8 KV: scheme, calibration, scales [layers][k, v][kv_heads]


@dataclass(frozen=True, slots=True)
class GraphEntry:
    file: str
    inputs: list[dict]
    outputs: list[dict]
    bytes: int  # size of the .onnx file (weights live in the shared data file)


@dataclass(frozen=True, slots=True)
class Manifest:
    schema_version: int
    kvexport_version: str
    source: dict
    model: dict  # ModelSpec.to_json()
    dtype: str  # weights/activations
    kv: KVSpec
    graphs: dict[str, GraphEntry]  # "prefill" / "decode"
    weights: dict  # {"file": ..., "bytes": ...}
    tokenizer: str | None  # folder inside the build, or None
    all_logits: bool  # prefill returns logits for every token
    validation: dict | None
    tools: dict
    notes: list[str] = field(default_factory=list)
    samples: dict[str, str] = field(default_factory=dict)  # phase -> polygraphy input file
    engines: dict | None = None  # TensorRT engines (exporter/tensorrt_build.py), when built

    def to_json(self) -> dict:
        return asdict(self)

    def save(self, build_dir: Path) -> None:
        """Write kvexport.json atomically (temp file + rename: never half-written, and a
        hard-linked copy of a build keeps its own manifest)."""
        build_dir = Path(build_dir)
        fd, tmp = tempfile.mkstemp(prefix=f".{io.MANIFEST_NAME}.", dir=build_dir)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.to_json(), indent=2) + "\n")
            os.replace(tmp, build_dir / io.MANIFEST_NAME)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        version = d.get("schema_version")
        if version != io.SCHEMA_VERSION:
            raise ManifestError(f"manifest field 'schema_version' is {version!r}; this kvexport reads "
                                f"{io.SCHEMA_VERSION}: rebuild with `kvexport build --force`")
        try:
            d = dict(d)
            d["kv"] = KVSpec(**d["kv"])
            d["graphs"] = {k: GraphEntry(**v) for k, v in d["graphs"].items()}
            w = d["weights"]
            if not (isinstance(w.get("file"), str) and isinstance(w.get("bytes"), int)):
                raise TypeError(f"field 'weights' needs 'file' (str) and 'bytes' (int), got {w!r}")
            return cls(**d)
        except (KeyError, TypeError, AttributeError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise ManifestError(f"manifest is malformed ({what}); rebuild with `kvexport build --force`") from None


def load(build_dir: str | Path) -> Manifest:
    """Read and check a build directory's manifest; every referenced file must exist."""
    build_dir = Path(build_dir)
    path = build_dir / io.MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{build_dir} has no {io.MANIFEST_NAME}: it is not a (complete) kvexport "
                            f"build; run `kvexport build MODEL --out {build_dir}`")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is corrupt ({e}); rebuild with `kvexport build --force`") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{path} is corrupt (not a JSON object); rebuild with `kvexport build --force`")
    try:
        m = Manifest.from_json(data)
    except ManifestError as e:
        raise ManifestError(f"{path}: {e}") from None
    rebuild = "rebuild with `kvexport build --force`"
    for entry in m.graphs.values():
        if not (build_dir / entry.file).is_file():
            raise ManifestError(f"{build_dir / entry.file} listed in the manifest is missing; {rebuild}")
    weights = build_dir / m.weights["file"]
    if not weights.is_file():
        raise ManifestError(f"{weights} listed in the manifest is missing; {rebuild}")
    if (size := weights.stat().st_size) != m.weights["bytes"]:
        raise ManifestError(f"{weights} has {size} bytes, the manifest says {m.weights['bytes']} "
                            f"(truncated?); {rebuild}")
    return m


def versions() -> dict:
    import importlib.metadata as md

    out = {"kvexport": __version__}
    for pkg in ("torch", "transformers", "onnx", "onnxruntime", "numpy", "gguf"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out
