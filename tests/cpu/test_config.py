import pytest

from bcg_plugin import BcgConfig, BcgConfigError


def test_defaults_are_off():
    cfg = BcgConfig.from_mapping(None)
    assert cfg.enable is False and not cfg.active


def test_valid_config_round_trip():
    cfg = BcgConfig.from_mapping({"enable": True, "max_tokens": 2048, "sizes": [64, 16], "max_padding_ratio": 2})
    assert cfg.sizes == (16, 64) and cfg.max_tokens == 2048 and cfg.max_padding_ratio == 2.0
    assert BcgConfig.from_mapping(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": "lots"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"sizes": [16, -32]}, "sizes"),
        ({"sizes": [16, 2.5]}, "sizes"),
        ({"sizes": "16,32"}, "sizes"),
        ({"sizes": []}, "sizes"),
        ({"sizes": [16, 16]}, "sizes"),
        ({"max_tokens": 64, "sizes": [16, 128]}, "sizes"),
        ({"enable": "maybe"}, "enable"),
        ({"max_padding_ratio": 0.5}, "max_padding_ratio"),
        ({"capture_failure": "ignore"}, "capture_failure"),
        ({"warmup": "never"}, "warmup"),
        ({"attention": "inline"}, "attention"),
        ({"attention": True}, "attention"),
        ({"max_token": 16}, "max_token"),
    ],
)
def test_bad_input_names_the_key(raw, key):
    with pytest.raises(BcgConfigError) as info:
        BcgConfig.from_mapping(raw, source="additional_config['bcg']")
    msg = str(info.value)
    assert key in msg and "additional_config['bcg']" in msg


def test_unknown_key_lists_known_keys():
    with pytest.raises(BcgConfigError, match="known keys are .*max_tokens"):
        BcgConfig.from_mapping({"enabled": True})


def test_not_a_mapping():
    with pytest.raises(BcgConfigError, match="JSON object"):
        BcgConfig.from_mapping([1, 2])


def test_from_json_errors_are_clear():
    with pytest.raises(BcgConfigError, match="not valid JSON"):
        BcgConfig.from_json("{enable: true}")


def test_from_env():
    cfg = BcgConfig.from_env({"BCG_ENABLE": "1", "BCG_SIZES": "16, 32", "OTHER": "x"})
    assert cfg.enable and cfg.sizes == (16, 32)
    assert BcgConfig.from_env({}) is None
    with pytest.raises(BcgConfigError, match="environment.*max_tokens"):
        BcgConfig.from_env({"BCG_MAX_TOKENS": "-3"})


def test_unknown_keys_of_any_type_are_named():
    with pytest.raises(BcgConfigError, match=r"unknown key\(s\) 'x', 1;"):
        BcgConfig.from_mapping({1: True, "x": 1, "enable": True})


@pytest.mark.parametrize("text", ["16 32", "16,,32", "16,32,", "16,,x", "-16", "16;32", "16,\u00b2"])
def test_sizes_from_the_environment_are_integers_each_between_commas(text):
    """``16 32`` is not the bucket 1632, nor ``16,,32`` three sizes: refused with the variable named."""
    with pytest.raises(BcgConfigError, match="BCG_SIZES must be positive integers separated by commas"):
        BcgConfig.from_env({"BCG_SIZES": text})


def test_chunk_size_resolution_and_zero_disables():
    assert BcgConfig(enable=True).with_chunk_size(8192).max_tokens == 8192
    assert BcgConfig(enable=True, max_tokens=16384).with_chunk_size(8192).max_tokens == 8192
    assert not BcgConfig(enable=True, max_tokens=0).active


def test_attention_is_auto_unless_chosen():
    assert BcgConfig.from_mapping({}).attention == "auto"
    assert BcgConfig.from_env({"BCG_ATTENTION": "break"}).attention == "break"
    assert BcgConfig.from_mapping({"attention": "graph"}).attention == "graph"
