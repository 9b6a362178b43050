"""kvexport/graph_check.py rule 5: a manifest cannot claim a context the graphs' position
tables do not hold. An edited `kv.max_seq_len` (before: loaded, served, and a prompt past the
RoPE table ended in an onnxruntime out-of-bounds Gather after the whole prefill ran) is refused
at load with a ManifestError naming the field, the rows the graphs hold, and to rebuild.
(Rules 1-4, the graphs' I/O: tests/test_manifest.py.)"""

import json
import shutil
from pathlib import Path

import pytest

from kvexport import io
from kvexport.errors import ManifestError
from kvexport.exporter.build import BuildOptions, build
from kvexport.manifest import load
from kvexport.runtime.llm import LLM


@pytest.fixture(scope="module")
def builds(hf_folder, tmp_path_factory):
    """family -> a tiny unvalidated paged build of context 64: llama (RoPE) and gpt2 (256 learned positions)."""
    root = tmp_path_factory.mktemp("graph-check")
    return {family: build(str(hf_folder(family)), root / family, BuildOptions(max_seq_len=64, validate=False))[0]
            for family in ("llama", "gpt2")}


def edited(src: Path, dst: Path, edit) -> Path:
    """A copy of build `src` at `dst` whose manifest `edit(data)` changed."""
    shutil.copytree(src, dst)
    path = dst / io.MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return dst


def claim(n: int):
    def edit(data):
        data["kv"]["max_seq_len"] = n
    return edit


@pytest.mark.parametrize("n", [100000, 65, 32])
def test_a_context_the_rope_tables_do_not_hold_is_refused(builds, tmp_path, n):
    d = edited(builds["llama"], tmp_path / "b", claim(n))
    with pytest.raises(ManifestError) as e:
        load(d)
    msg = str(e.value)
    assert f"manifest field 'kv.max_seq_len' is {n}, but prefill.onnx's RoPE table 'rope.cos' has 64 rows: the " \
           f"graphs serve positions 0..63, a context of 64 tokens; rebuild with `kvexport build MODEL " \
           f"--max-seq-len {n} --force`" in msg, msg
    with pytest.raises(ManifestError, match="'kv.max_seq_len' is"):  # the serving path loads the same way
        LLM(d, kv_cache_memory="16MiB")


def test_learned_positions_bound_the_context(builds, tmp_path):
    """gpt2's learned table has the model's 256 positions: a claim up to them is servable, past them refused."""
    load(edited(builds["gpt2"], tmp_path / "ok", claim(256)))
    d = edited(builds["gpt2"], tmp_path / "b", claim(257))
    with pytest.raises(ManifestError) as e:
        load(d)
    assert "manifest field 'kv.max_seq_len' is 257, but prefill.onnx's learned position table " \
           "'model.embed_positions.weight' has 256 rows" in str(e.value), e.value


def test_rotary_width_is_checked(builds, tmp_path):
    def half_rotary(data):
        data["model"]["rope"]["partial_rotary_factor"] = 0.5

    d = edited(builds["llama"], tmp_path / "b", half_rotary)
    with pytest.raises(ManifestError) as e:
        load(d)
    assert "manifest fields 'model.head_dim' / 'model.rope.partial_rotary_factor' give 4 rotated channel pairs, " \
           "but prefill.onnx's RoPE table 'rope.cos' has 8" in str(e.value), e.value


def test_the_built_claims_load(builds):
    for d in builds.values():
        assert load(d).kv.max_seq_len == 64
