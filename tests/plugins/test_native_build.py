"""Building the native op library (plugins/paged_attention/native.py build()): its sources compile
as separate objects at the same time; a failing compile is reported with the source's name and
g++'s message, and leaves nothing behind (no library, no scratch folder)."""

from __future__ import annotations

import shutil

import pytest

from kvexport.errors import KvExportError
from kvexport.plugins.paged_attention import native


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_a_failing_compile_names_the_source_and_leaves_nothing(tmp_path):
    include = tmp_path / "include"
    include.mkdir()
    (include / "onnxruntime_cxx_api.h").write_text('#error "not the onnxruntime headers"\n')
    out = tmp_path / "lib" / native.LIB_NAME
    with pytest.raises(KvExportError, match=r"compiling paged_attention_ort\.cc failed:(.|\n)*"
                                            r"-c (.|\n)*not the onnxruntime headers"):
        native.build(include, out)
    assert list(out.parent.iterdir()) == []


def test_headers_without_the_cxx_api_are_refused(tmp_path):
    with pytest.raises(KvExportError, match="has no onnxruntime_cxx_api.h"):
        native.build(tmp_path, tmp_path / native.LIB_NAME)
