"""Speculative decoding as the engine sets it up: the policy `EngineConfig.speculative` asks for,
checked against the build (core/speculation.py), and the proposer that drafts for it on the
runner's side (execution/proposers.py: the n-gram lookup and the `Drafter`; runtime/draft_model.py:
the draft model, since it runs a second build's graphs)."""

from __future__ import annotations

from pathlib import Path

from kvexport.errors import ConfigError
from kvexport.manifest import Manifest

from .config import EngineConfig
from .core.speculation import SpeculativeDecoding
from .execution.proposers import Drafter, NgramProposer


def speculation_policy(build_dir: Path, manifest: Manifest, config: EngineConfig) -> SpeculativeDecoding | None:
    """The speculation policy of `config` for this build, or None (speculative "none"). A build
    whose graphs return only each sequence's last logits cannot verify drafts: ConfigError."""
    if config.speculative == "none":
        return None
    if not manifest.scores_prompts:
        raise ConfigError(f"speculative {config.speculative!r}: {build_dir} returns only each sequence's last logits "
                          f"(made before logits_indices), so drafts cannot be verified; rebuild it with this kvexport "
                          f"(`kvexport build MODEL --force`) or serve it with --speculative none")
    return SpeculativeDecoding(config.num_speculative_tokens, config.speculative_max_batch,
                               cost_model=config.speculative_cost_model,
                               costly_proposer=config.speculative == "draft")


def drafter_for(build_dir: Path, manifest: Manifest, config: EngineConfig,
                policy: SpeculativeDecoding | None) -> Drafter | None:
    """The runner's drafter with the proposer `config.speculative` names, drafting for the requests
    `policy` plans (None when speculation is off). The draft model is opened and checked against the
    build here (ConfigError naming draft_model)."""
    if policy is None:
        return None
    if config.speculative == "ngram":
        return Drafter(NgramProposer())
    from .draft_model import DraftModelProposer

    return Drafter(DraftModelProposer.open(config.draft_model, build_dir, manifest, config))


__all__ = ["drafter_for", "speculation_policy"]
