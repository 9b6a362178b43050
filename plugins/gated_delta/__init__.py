"""kvexport::GatedDeltaRule: the gated delta rule of gated DeltaNet layers (Qwen3.5, Qwen3-Next) over
packed sequences with their recurrent state read from the state pool by slot, one node per linear
layer in hybrid `plugin` graphs (README.md: the files and what each owns)."""

from .spec import OP_TYPE, PLUGIN_ID, GatedDeltaAttrs  # noqa: F401
