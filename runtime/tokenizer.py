"""The build's tokenizer: its `tokenizer/` folder (the manifest names it) loaded with
transformers, from that folder only. A folder that is gone, empty or unreadable is a
ManifestError saying what to do, never transformers' fallback to the Hugging Face hub (which
reads the path as a repository id and reports that it cannot reach the hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvexport.errors import ManifestError
from kvexport.manifest import missing_tokenizer


def load_build_tokenizer(build_dir: Path, folder: str) -> Any:
    """The transformers tokenizer in `build_dir / folder`; ManifestError when it cannot be loaded."""
    path = build_dir / folder
    if not path.is_dir() or not any(path.iterdir()):
        raise ManifestError(missing_tokenizer(build_dir, folder, "" if not path.is_dir() else "the folder is empty"))
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for broken tokenizer files
        said = " ".join(str(e).split())  # one line
        said = said if len(said) <= 200 else said[:200] + "…"
        raise ManifestError(missing_tokenizer(build_dir, folder, f"{type(e).__name__}: {said}")) from None
