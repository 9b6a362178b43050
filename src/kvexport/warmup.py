"""Import what the main job (`kvexport build` of the default model, then `kvexport generate`) imports, so Python
writes those modules' bytecode once: scripts/install.sh runs `python -m kvexport.warmup` after installing without
pip's compile of every module of every package (torch alone: ~23 s of one core). A module this misses is compiled
when first imported, as Python does."""

from __future__ import annotations

import importlib

MODULES = (
    "kvexport.cli", "kvexport.cli.build", "kvexport.exporter.build", "kvexport.exporter.source",
    "kvexport.exporter.validate", "kvexport.exporter.gguf_cache", "kvexport.runtime.llm", "kvexport.runtime.engine",
    "transformers.models.llama.modeling_llama", "transformers.models.auto.modeling_auto", "onnxruntime", "onnx",
    "onnxscript", "gguf",
)


def main() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a warm-up only: the command that needs the module reports it
            pass


if __name__ == "__main__":
    main()
