"""kvexport::PagedMLA: absorbed multi-head latent attention (DeepSeek-V2/V3) over a paged pool of
latent rows, one node per layer in MLA `plugin` graphs (README.md: the files and what each owns)."""

from .spec import OP_TYPE, PLUGIN_ID, PagedMLAAttrs  # noqa: F401
