"""Helpers the test suite shares, importable as `testkit` (pyproject.toml's pytest `pythonpath`):
the tiny per-family configs (families.py), the parity harness (parity.py), the MoE block
harness (moe_blocks.py) and small tokenizers (text.py). No test imports another test file."""
