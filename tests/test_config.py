import json

import pytest

from kvtier.config import Config, ConfigError


def test_defaults_validate():
    c = Config()
    c.validate()
    assert c.dram_capacity == 4 * 2**30 and c.eviction == "lru"


def test_from_dict_parses_sizes_and_bools():
    c = Config.from_dict({"dram_capacity": "64MiB", "dram_prefault": "yes", "copy_threads": "2"})
    assert (c.dram_capacity, c.dram_prefault, c.copy_threads) == (64 * 2**20, True, 2)


def test_unknown_key_is_named_with_suggestion():
    with pytest.raises(ConfigError, match=r"unknown config key 'dram_capasity'; did you mean dram_capacity"):
        Config.from_dict({"dram_capasity": "1GiB"})


@pytest.mark.parametrize("values,match", [
    ({"dram_capacity": "lots"}, "dram_capacity: not a byte size"),
    ({"dram_capacity": 0}, "dram_capacity must be > 0"),
    ({"dram_pin_memory": "maybe"}, "dram_pin_memory: 'maybe' is not one of"),
    ({"copy_threads": 1.5}, "copy_threads: expected an integer"),
    ({"dram_prefault": "perhaps"}, "dram_prefault: expected a boolean"),
    ({"model": ["a"]}, "model: expected a string"),
])
def test_bad_values_are_named(values, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_dict(values)


def test_json_and_toml_files(tmp_path):
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"dram_capacity": "2GiB", "eviction": "s3fifo"}))
    t = tmp_path / "c.toml"
    t.write_text('[kvtier]\ndram_capacity = "3GiB"\ncopy_threads = 2\n')
    assert Config.from_file(j).eviction == "s3fifo"
    assert Config.from_file(t).dram_capacity == 3 * 2**30
    bad = tmp_path / "bad.toml"
    bad.write_text("dram_capacity = \n")
    with pytest.raises(ConfigError, match="bad.toml is not valid toml"):
        Config.from_file(bad)
    typo = tmp_path / "typo.json"
    typo.write_text('{"evicton": "lru"}')
    with pytest.raises(ConfigError, match="typo.json: unknown config key 'evicton'"):
        Config.from_file(typo)


def test_env_and_precedence(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"dram_capacity": "1GiB", "eviction": "s3fifo", "copy_threads": 2}))
    env = {"KVTIER_CONFIG": str(f), "KVTIER_DRAM_CAPACITY": "2GiB", "KVTIER_COPY_THREADS": "3", "HOME": "/x"}
    c = Config.load({"copy_threads": 4}, environ=env)
    # file < env < dict
    assert (c.eviction, c.dram_capacity, c.copy_threads) == ("s3fifo", 2 * 2**30, 4)
    with pytest.raises(ConfigError, match="environment: unknown config key 'dram_capacty'.*KVTIER_"):
        Config.load(None, environ={"KVTIER_DRAM_CAPACTY": "1GiB"})
