"""Speculative decoding as the engine sets it up: the policy `EngineConfig.speculative` asks for,
checked against the build (core/speculation.py has the policy and the n-gram proposer; the draft
model's proposer is runtime/draft_model.py, since it runs a second build's graphs)."""

from __future__ import annotations

from pathlib import Path

from kvexport.errors import ConfigError
from kvexport.manifest import Manifest

from .config import EngineConfig
from .core.speculation import NgramProposer, SpeculativeDecoding


def speculation_policy(build_dir: Path, manifest: Manifest, config: EngineConfig) -> SpeculativeDecoding | None:
    """The speculation policy of `config` for this build, or None (speculative "none"). A build
    whose graphs return only each sequence's last logits cannot verify drafts: ConfigError."""
    if config.speculative == "none":
        return None
    if not manifest.scores_prompts:
        raise ConfigError(f"speculative {config.speculative!r}: {build_dir} returns only each sequence's last logits "
                          f"(made before logits_indices), so drafts cannot be verified; rebuild it with this kvexport "
                          f"(`kvexport build MODEL --force`) or serve it with --speculative none")
    if config.speculative == "ngram":
        proposer = NgramProposer()
    else:
        from .draft_model import DraftModelProposer

        proposer = DraftModelProposer.open(config.draft_model, build_dir, manifest, config)
    return SpeculativeDecoding(proposer, config.num_speculative_tokens, config.speculative_max_batch,
                               cost_model=config.speculative_cost_model)


__all__ = ["speculation_policy"]
