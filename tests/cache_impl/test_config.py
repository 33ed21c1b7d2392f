"""A wrong cache setting is refused with the field path, what was expected and what was found."""

import pytest

from cache_impl import CacheConfig, ConfigError, TieredKVCache
from cache_impl.cache.config import RemoteTierConfig, parse_size


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"block_size": 0}, "cache.block_size: expected a value >= 1, found 0"),
        ({"block_size": "big"}, "cache.block_size: expected an integer, found 'big'"),
        (
            {"write_policy": "sometimes"},
            "cache.write_policy: expected one of 'write-through' or 'write-back', found 'sometimes'",
        ),
        ({"blok_size": 16}, "cache.blok_size: unknown field"),
        ({"host_capacity_bytes": "lots"}, "cache.host_capacity_bytes: expected a byte size"),
        ({"disk": {"capacity_bytes": "1GiB"}}, "cache.disk.path: expected a value (required), found nothing"),
        ({"disk": {"path": "/tmp/x", "read_workers": 0}}, "cache.disk.read_workers: expected a value >= 1, found 0"),
        (
            {"disk": {"path": "/tmp/x", "io_mode": "mmap"}},
            "cache.disk.io_mode: expected one of 'buffered', 'direct' or 'auto', found 'mmap'",
        ),
        ({"disk": {"path": "/tmp/x", "cold_read": True}}, "cache.disk.cold_read: unknown field"),
    ],
)
def test_bad_setting_names_field_expectation_and_finding(settings, message):
    with pytest.raises(ConfigError) as error:
        CacheConfig.from_dict(settings)
    assert message in str(error.value)


def test_sizes_accept_bytes_and_units():
    assert parse_size(4096) == 4096
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("2 GB") == 2 * 10**9
    config = CacheConfig.from_dict(
        {"host_capacity_bytes": "1GiB", "disk": {"path": "/tmp/x", "capacity_bytes": "3GiB"}}
    )
    assert config.host_capacity_bytes == 2**30 and config.disk.capacity_bytes == 3 * 2**30


def test_a_mooncake_url_gives_its_options_as_text_that_validation_parses():
    config = RemoteTierConfig.from_url("mooncake://master:50051?metadata=http://meta:8080/m&segment=256MiB"
                                       "&hostname=10.0.0.2")
    assert (config.backend, config.master, config.metadata_server) == ("mooncake", "master:50051", "http://meta:8080/m")
    assert config.segment_bytes == 256 * 2**20 and config.local_hostname == "10.0.0.2"
    with pytest.raises(ConfigError, match="remote: unknown option 'segments'"):
        RemoteTierConfig.from_url("mooncake://master:50051?segments=1GiB")


def test_block_size_must_match_the_kv_layout(fingerprint):
    with pytest.raises(ConfigError, match="cache.block_size: expected the KV layout's block size 4, found 256"):
        TieredKVCache(CacheConfig.from_dict({"block_size": 256, "device": "cpu"}), fingerprint)


def test_the_kv_layout_takes_its_block_size_from_the_cache_config_the_one_place_it_is_given(fingerprint):
    config = CacheConfig.from_dict({"block_size": 4, "device": "cpu"})
    layout = config.layout(fingerprint.layout.num_layers, fingerprint.layout.num_kv_heads,
                           fingerprint.layout.head_dim, fingerprint.layout.dtype)
    assert layout == fingerprint.layout and layout.block_size == 4
    assert CacheConfig.from_dict({"block_size": 128}).layout(2, 2, 8, "float32").block_shape == (2, 2, 2, 128, 8)


def test_defaults_are_valid_and_documented():
    config = CacheConfig.from_dict(None)
    assert config.block_size == 256 and config.write_policy == "write-through" and config.disk is None
    assert all(field.description for field in CacheConfig.model_fields.values())
