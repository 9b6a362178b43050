"""What transformers makes of a GGUF file, kept: its config, its tokenizer and its float32 weights, saved
once as an HF folder's files and read from there afterwards.

transformers' GGUF loader parses the whole file each time it reads the config, the tokenizer or the weights
(the tokenizer's arrays included: ~10 s for SmolLM2-135M's 49k tokens and merges, four parses per build) and
builds its tensor-name map once per module (~11 s): ~60 s of a 80 s smollm2 build. The cache turns the
second and later loads of the same file into reads of config.json, tokenizer.json and safetensors (~2 s).

    $KVEXPORT_CACHE_DIR (else $XDG_CACHE_HOME/kvexport, else ~/.cache/kvexport)
      gguf/<sha256 of the file + transformers' version>/
        metadata/          metadata.json: the header fields source.gguf_metadata reads
        config/            AutoConfig.save_pretrained (GGUF_CONFIG_FILL applied)
        tokenizer/         AutoTokenizer.save_pretrained
        model/             the float32 model (save_model: config.json, generation_config.json, safetensors),
                           only when the weights hold at most WEIGHTS_CAP bytes (a 7B model would be ~28 GB)

Each part is written to a temporary folder beside it and renamed into place, so a part is whole or absent;
two processes converting the same file at once each write their own and the first rename wins. A cache that
cannot be written (read-only home, full disk) is logged and skipped: loading then works as without it.
`KVEXPORT_CACHE_DIR=off` turns it off. NOTE: the key holds the file's content hash, not its path or mtime,
so a file replaced in place never reads another file's conversion.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvexport.manifest import sha256

log = logging.getLogger(__name__)

CACHE_ENV = "KVEXPORT_CACHE_DIR"
OFF = ("off", "0", "none", "false")
WEIGHTS_CAP = 4 << 30  # bytes of float32 weights above which `model/` is not written


def root() -> Path | None:
    """The cache folder, or None when $KVEXPORT_CACHE_DIR turns the cache off."""
    named = os.environ.get(CACHE_ENV)
    if named is not None:
        return None if named.strip().lower() in OFF or not named.strip() else Path(named)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvexport"


def entry(gguf_path: Path) -> Path | None:
    """The cache folder of one GGUF file (it may not exist yet), or None when the cache is off."""
    base = root()
    if base is None:
        return None
    import transformers

    return base / "gguf" / f"{file_sha256(gguf_path)[:32]}-transformers-{transformers.__version__}"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a source file, hashed once per (path, size, mtime) in this process: the cache key and the
    manifest's record of the source (ModelSource.to_json) read the same value, not the file twice."""
    st = Path(path).stat()
    return _sha256(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    return sha256(Path(path))


def part(gguf_path: Path, name: str) -> Path | None:
    """The cached part `name` (metadata, config, tokenizer, model) of the file, or None when absent."""
    e = entry(gguf_path)
    p = e / name if e is not None else None
    return p if p is not None and p.exists() else None


def store(gguf_path: Path, name: str, write: Callable[[Path], None]) -> None:
    """Write part `name` of the file's cache: `write(folder)` fills a temporary folder, which is renamed into
    place. Any failure (the cache not writable, `write` raising) is logged and leaves no part behind."""
    e = entry(gguf_path)
    if e is None:
        return
    tmp = None
    try:
        e.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=e))
        write(tmp)
        os.rename(tmp, e / name)  # NOTE: atomic; fails when another process renamed its copy first
        tmp = None
    except OSError as err:
        if not (e / name).exists():
            log.warning("the GGUF cache %s could not be written (%s); loading goes on without it "
                        "(set %s to a writable folder, or to 'off')", e, err, CACHE_ENV)
    except Exception as err:  # noqa: BLE001 - a conversion that cannot be saved is still a loaded model
        log.warning("part %r of the GGUF cache %s could not be saved (%s: %s); loading goes on without it",
                    name, e, type(err).__name__, err)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def drop(gguf_path: Path, name: str) -> None:
    """Remove a part that could not be read back (a damaged cache), so the next load converts again."""
    p = part(gguf_path, name)
    if p is not None:
        log.warning("the cached %s of %s could not be read; converting the GGUF file again", name, gguf_path)
        shutil.rmtree(p, ignore_errors=True)  # every part is a folder


def metadata(gguf_path: Path, read: Callable[[], dict]) -> dict:
    """The file's header fields: cached metadata.json, else `read()`, stored (JSON: str and int values)."""
    p = part(gguf_path, "metadata")
    if p is not None:
        try:
            return json.loads((p / "metadata.json").read_text())
        except (OSError, ValueError):
            drop(gguf_path, "metadata")
    meta = read()
    store(gguf_path, "metadata", lambda d: (d / "metadata.json").write_text(json.dumps(meta)))
    return meta


def fits(model) -> bool:
    """Whether the model's float32 weights fit WEIGHTS_CAP (`model/` is written only then)."""
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if nbytes > WEIGHTS_CAP:
        log.info("%.1f GiB of float32 weights is above the GGUF cache's %.0f GiB cap: not cached",
                 nbytes / 2**30, WEIGHTS_CAP / 2**30)
    return nbytes <= WEIGHTS_CAP


def save_model(model, folder: Path) -> None:
    """`model/`: config.json (without the GGUF quantization_config: the weights are float32 now),
    generation_config.json and model.safetensors (a tied head stored once)."""
    import copy

    import safetensors.torch

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # NOTE: else transformers would load the folder as a GGUF model
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    safetensors.torch.save_model(model, str(folder / "model.safetensors"))
