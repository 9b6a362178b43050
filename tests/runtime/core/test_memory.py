"""Size strings and KV block budgets."""

import pytest

from kvexport.errors import ConfigError
from kvexport.io import DType, kv_bytes_per_token
from kvexport.runtime.core.memory import num_blocks_for_budget, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("2GiB", 2 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("1.5 gib", 3 * 1024**3 // 2),
        (" 64 KiB ", 65536),
        ("1TB", 10**12),
        ("4096", 4096),
        ("10B", 10),
        ("0.5KiB", 512),
        (".5kb", 500),
        ("0.3KiB", 307),  # rounded down to whole bytes
        ("0", 0),
        (123, 123),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", ["", "GiB", "2 GiBs", "-1GiB", "2XB", "1e9", "1.2.3MB", "2 G iB", "nan", -5, 1.5, True, None]
)
def test_parse_size_rejects_with_a_clear_message(bad):
    with pytest.raises(ConfigError, match="size"):
        parse_size(bad)


def test_parse_size_message_lists_units():
    with pytest.raises(ConfigError, match="GiB.*MiB|MiB.*GiB"):
        parse_size("lots")


def test_num_blocks_for_budget_smollm2_fp16():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64 -> 23040 bytes per token in fp16
    per_token = kv_bytes_per_token(30, 3, 64, DType.FP16)
    assert per_token == 23040
    assert num_blocks_for_budget(parse_size("1GiB"), per_token, 16) == 2912  # 2^30 // 368640
    assert num_blocks_for_budget(2 * 16 * per_token, per_token, 16) == 2
    assert num_blocks_for_budget(3 * 16 * per_token - 1, per_token, 16) == 2


def test_num_blocks_for_budget_too_small_says_what_to_do():
    with pytest.raises(ConfigError, match=r">= 736 bytes"):
        num_blocks_for_budget(735, 23, 16)
    assert num_blocks_for_budget(736, 23, 16) == 2


@pytest.mark.parametrize("args", [(0, 8, 16), (1024, 0, 16), (1024, 8, 0), (1024.0, 8, 16), (1024, -8, 16)])
def test_num_blocks_for_budget_rejects_bad_arguments(args):
    with pytest.raises(ConfigError):
        num_blocks_for_budget(*args)
