"""Which builds may exchange KV blocks (issue 31 §7, the Dynamo trial: bench/dynamo_trial.py): a
prefill worker and a decode worker hand blocks over only when their build identity
(kv_offload.build_identity) is equal. Two builds of one source whose weights files differ but
have the same size (another kvexport's weight transform, a re-export, a file replaced along with
its recorded checksum) must not share it: the trial's decode worker took such a prefill worker's
blocks and served them. The disk tier uses the same identity, so it keeps the same rule."""

import dataclasses

from kvexport import manifest as manifest_mod
from kvexport.runtime.execution.kv_offload import build_identity


def test_builds_whose_weights_differ_have_other_identities(chat_build):
    m = manifest_mod.load(chat_build)
    same_size = dataclasses.replace(m, weights=dataclasses.replace(m.weights, sha256="0" * 64))
    assert same_size.weights.bytes == m.weights.bytes and same_size.source == m.source
    assert build_identity(same_size, {}) != build_identity(m, {})
    assert build_identity(dataclasses.replace(m), {}) == build_identity(m, {})  # the same build: the same identity
