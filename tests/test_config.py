import json
import re
from dataclasses import fields
from pathlib import Path

import pytest

from kvtier.config import ENV_NOT_CONFIG, Config, ConfigError


def test_defaults_validate():
    c = Config()
    c.validate()
    assert c.dram_capacity == 4 * 2**30 and c.eviction == "default"


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


def test_layers_are_merged_before_the_config_is_validated(tmp_path, monkeypatch):
    """A layer need not be valid alone: the pool endpoint from the environment and the mode from the dict make one
    valid standalone config, and a dict may clear a file's ssd_path for it (each failed at load before: the
    environment's or the file's layer was validated before the dict was applied)."""
    pool = "ipc:///run/kvtier/pool.sock"
    c = Config.load({"mode": "standalone"}, environ={"KVTIER_POOL": pool})
    assert (c.mode, c.pool) == ("standalone", pool)
    f = tmp_path / "c.toml"
    f.write_text(f'ssd_path = "{tmp_path / "ssd"}"\nmode = "standalone"\n')
    c = Config.load({"ssd_path": ""}, environ={"KVTIER_CONFIG": str(f), "KVTIER_POOL": pool})
    assert (c.mode, c.ssd_path, c.pool) == ("standalone", "", pool)
    # ... and validated once, whole
    calls = []
    real = Config.validate
    monkeypatch.setattr(Config, "validate", lambda self: calls.append(1) or real(self))
    Config.load({"mode": "standalone"}, environ={"KVTIER_CONFIG": str(f), "KVTIER_POOL": pool,
                                                 "KVTIER_SSD_PATH": ""})
    assert len(calls) == 1


def test_a_merged_config_that_breaks_a_rule_names_the_layers_and_their_keys(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"ssd_path": str(tmp_path / "ssd")}))
    with pytest.raises(ConfigError, match=r"mode 'standalone' keeps no SSD tier .*\[keys set by: config file "
                                          r".*c\.json \(ssd_path\); environment \(pool\); the dict \(mode\)\]"):
        Config.load({"mode": "standalone"}, environ={"KVTIER_CONFIG": str(f), "KVTIER_POOL": "ipc:///p.sock"})
    with pytest.raises(ConfigError, match=r"^dram_capacity must be > 0, got 0 \[keys set by: environment "
                                          r"\(dram_capacity\); the dict \(dram_capacity\)\]"):
        Config.load({"dram_capacity": 0}, environ={"KVTIER_DRAM_CAPACITY": "1GiB"})


def test_non_config_variables_are_not_keys():
    # The build and library switches live in the same KVTIER_ namespace; a store must still start with them set.
    env = {"KVTIER_CACHE_DIR": "/tmp/x", "KVTIER_CUDA_ARCH": "90", "KVTIER_NATIVE_CPU": "0",
           "KVTIER_RDMA_DEVICE": "mlx5_0:1:3", "KVTIER_ENGINE_PYTHON": "/opt/engine/bin/python",
           "KVTIER_RUNTIME_DIR": "/tmp/kvtier-tokens", "KVTIER_DRAM_CAPACITY": "2GiB"}
    assert Config.load(None, environ=env).dram_capacity == 2 * 2**30
    assert ENV_NOT_CONFIG == {"KVTIER_CONFIG", "KVTIER_CACHE_DIR", "KVTIER_CUDA_ARCH", "KVTIER_NATIVE_CPU",
                              "KVTIER_RDMA_DEVICE", "KVTIER_ENGINE_PYTHON", "KVTIER_RUNTIME_DIR"}


def test_the_configuration_page_names_every_variable_that_is_not_a_key():
    page = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    missing = sorted(name for name in ENV_NOT_CONFIG if f"`{name}" not in page)
    assert not missing, f"docs/configuration.md does not name {missing}"


def test_every_kvtier_variable_in_the_tree_is_a_key_or_reserved():
    """A new KVTIER_ variable read anywhere must be a config key or listed in ENV_NOT_CONFIG, or every store
    started with it set would fail with 'unknown config key'."""
    root = Path(__file__).resolve().parent.parent
    keys = {f"KVTIER_{f.name.upper()}" for f in fields(Config)}
    found = set()
    for folder in ("kvtier", "master", "connectors", "bench"):
        for path in (root / folder).rglob("*.py"):
            found.update((m, path.name) for m in re.findall(r"\bKVTIER_[A-Z][A-Z0-9_]*", path.read_text()))
    assert found, "the scan found no KVTIER_ names at all: the tree layout changed"
    stray = sorted((name, file) for name, file in found if name not in keys | ENV_NOT_CONFIG)
    assert not stray, f"KVTIER_ variables that are neither config keys nor in ENV_NOT_CONFIG: {stray}"


# ---- docs/configuration.md's table, rendered from the declarations (docs/gen_config.py, an mkdocs hook) ----------


def _gen_config():
    """docs/gen_config.py, the mkdocs hook that renders the table (a file of docs/, not a module of the package)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "docs" / "gen_config.py"
    spec = importlib.util.spec_from_file_location("kvtier_docs_gen_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_page_holds_the_generated_table_not_a_written_one():
    gen = _gen_config()
    page = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    assert page.count(gen.CONFIG_PLACEHOLDER) == 1  # the hook fills it; mkdocs build --strict fails without it
    written = re.findall(r"^\| `([a-z_]+)` \|", page, re.M)
    assert not written, f"docs/configuration.md writes rows the declarations render: {written}"


def test_the_generated_table_has_a_row_for_every_key_with_its_default_and_help():
    gen = _gen_config()
    rows = re.findall(r"^\| `([a-z_]+)` \| (.*?) \| (.*) \|$", gen.config_table(), re.M)
    assert [key for key, _, _ in rows] == [key for key, _, _ in Config.describe()]  # DRAM, SSD, pool, store
    by_key = {key: (default, meaning) for key, default, meaning in rows}
    assert by_key["dram_capacity"][0] == "4GiB" and by_key["ssd_segment_bytes"][0] == "256MiB"  # as declared
    assert by_key["ssd_fsync"][0] == "true" and by_key["dram_shm_path"][0] == '""'
    assert by_key["close_timeout_s"][0] == "30" and by_key["pool_timeout_ms"][0] == "500"
    assert all(meaning.strip() for _, meaning in by_key.values()), "a key without help"
    assert "[Eviction policies](eviction.md#eviction-policies)" in by_key["eviction"][1]  # docs/<page>.md 'Title'


# ---- one coercion for every key: store keys, the vLLM connector's, the SGLang backend's (issue 16) -----------

BOOL_WORDS = [("true", True), ("yes", True), ("on", True), ("1", True), ("TRUE", True), (" On ", True),
              ("false", False), ("no", False), ("off", False), ("0", False), ("Off", False), (True, True),
              (False, False), (1, True), (0, False)]


def _vllm_bool(raw):
    from kvtier.connectors.vllm.settings import split_extra_config

    return split_extra_config({"save_decode": raw})[0].save_decode


def _store_bool(raw):
    return Config.from_dict({"dram_prefault": raw}).dram_prefault


def _sglang_style_bool(raw):
    # The SGLang backend has no boolean key today; its settings go through the same coerce_fields.
    from dataclasses import dataclass

    from kvtier.config import coerce_fields

    @dataclass(frozen=True)
    class Settings:
        flag: bool = False

    return Settings(**coerce_fields(Settings, {"flag": raw})).flag


@pytest.mark.parametrize("read", [_store_bool, _vllm_bool, _sglang_style_bool], ids=["store", "vllm", "sglang"])
@pytest.mark.parametrize("raw,want", BOOL_WORDS, ids=[repr(w) for w, _ in BOOL_WORDS])
def test_every_reader_accepts_the_same_boolean_words(read, raw, want):
    assert read(raw) is want


@pytest.mark.parametrize("read,key", [(_store_bool, "dram_prefault"), (_vllm_bool, "save_decode"),
                                      (_sglang_style_bool, "flag")], ids=["store", "vllm", "sglang"])
@pytest.mark.parametrize("raw", ["maybe", "", 2, 0.5, None, ["yes"]])
def test_a_bad_boolean_names_the_key_and_the_words(read, key, raw):
    with pytest.raises(ConfigError, match=rf"{key}: expected a boolean \(true/false, yes/no, on/off, 1/0\)"):
        read(raw)


@pytest.mark.parametrize("raw,want", [("auto", "auto"), ("AUTO", "auto"), (False, "false"), ("off", "false"),
                                      ("no", "false"), (True, "true"), ("on", "true"), ("1", "true")])
def test_auto_switches_read_boolean_words(raw, want):
    # ssd_direct_io and dram_pin_memory are auto/true/false: a JSON false or "off" means false, as for a bool key.
    assert Config.from_dict({"ssd_direct_io": raw, "dram_pin_memory": raw}).ssd_direct_io == want


def test_sglang_backend_keys_use_the_store_coercion():
    from kvtier.connectors.sglang.settings import split_extra_config

    settings, _, _ = split_extra_config({"staging_bytes": "32MiB", "hint_max_fraction": "0.25"})
    assert (settings.staging_bytes, settings.hint_max_fraction) == (32 << 20, 0.25)
    with pytest.raises(ConfigError, match="hint_max_fraction: expected a number"):
        split_extra_config({"hint_max_fraction": True})


def test_sglang_extra_config_is_merged_with_the_environment_before_it_is_validated(monkeypatch):
    from kvtier.connectors.sglang.settings import split_extra_config

    monkeypatch.setenv("KVTIER_POOL", "ipc:///run/kvtier/pool.sock")
    _, _, config = split_extra_config({"mode": "standalone", "staging_bytes": "32MiB"})
    assert (config.mode, config.pool) == ("standalone", "ipc:///run/kvtier/pool.sock")


# ---- values a tier would refuse fail at load time, with the key named (issue 16) -------------------------------


@pytest.mark.parametrize("key", ["eviction", "ssd_eviction"])
@pytest.mark.parametrize("value", ["lruu", "LRU", "pnu2", "", "no.such.module:Policy", "kvtier.policies.lru:Nope"])
def test_an_unknown_eviction_policy_fails_at_load_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}: .*{re.escape(repr(value)) if value else ''}") as e:
        Config.from_dict({key: value})
    if ":" not in value:  # a name: the known names are listed
        assert "known: " in str(e.value) and "lru" in str(e.value) and "default" in str(e.value)


@pytest.mark.parametrize("value", ["default", "lru", "fifo", "s3fifo", "arc", "chain-lru", "pnu",
                                   "kvtier.policies.lru:LRUPolicy", "kvtier.policies.lru.LRUPolicy"])
def test_known_policies_and_import_paths_load(value):
    c = Config.from_dict({"eviction": value, "ssd_eviction": value})
    assert (c.eviction, c.ssd_eviction) == (value, value)


def test_an_unknown_policy_fails_in_the_connectors_settings_before_any_tier_is_built():
    # The vLLM scheduler and the SGLang server read their extra config first: a bad policy stops them there.
    from kvtier.connectors.sglang.settings import split_extra_config as sglang_split
    from kvtier.connectors.vllm.settings import split_extra_config as vllm_split

    with pytest.raises(ConfigError, match="kv_connector_extra_config: ssd_eviction: unknown eviction policy 'lfu'"):
        vllm_split({"ssd_path": "/nvme/x", "ssd_eviction": "lfu"})
    with pytest.raises(ConfigError, match="extra-config: eviction: unknown eviction policy 's4fifo'"):
        sglang_split({"eviction": "s4fifo"})


def test_an_unknown_policy_in_the_environment_or_a_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"eviction: unknown eviction policy 'lfu'.*\[keys set by: environment "
                                          r"\(eviction\)\]"):
        Config.from_env({"KVTIER_EVICTION": "lfu"})
    f = tmp_path / "c.toml"
    f.write_text('ssd_eviction = "belady"\n')
    with pytest.raises(ConfigError, match=r"ssd_eviction: unknown eviction policy 'belady'.*\[keys set by: config "
                                          r"file .*c\.toml \(ssd_eviction\)\]"):
        Config.from_file(f)


@pytest.mark.parametrize("values,pool,ssd", [
    ({}, True, True),
    ({"ssd_promote": False}, False, False),  # auto: as ssd_promote, which switched both before pool_promote
    ({"ssd_promote": False, "pool_promote": "on"}, True, False),
    ({"pool_promote": False}, False, True),
    ({"pool_promote": "auto", "ssd_promote": "no"}, False, False),
])
def test_pool_promote_is_its_own_key_defaulting_to_ssd_promote(values, pool, ssd):
    c = Config.from_dict(values)
    assert (c.pool_promotes, c.ssd_promote) == (pool, ssd)


@pytest.mark.parametrize("values,match", [
    ({"mode": "distributed", "master": "localhost:7300"}, r"master: 'localhost:7300' is not a tcp://host:port"),
    ({"mode": "distributed", "master": "tcp://a:7300,b:7300"}, r"master: 'b:7300' is not"),
    ({"mode": "distributed", "pool": "tcp://a:7400", "pool_transport": "shm"},
     r"pool_transport: 'shm' maps a pool on this host.*'tcp://a:7400'"),
])
def test_endpoints_a_pool_tier_cannot_use_fail_at_load(values, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_dict(values)


def test_endpoints_a_pool_tier_can_use_load():
    Config.from_dict({"mode": "distributed", "master": "tcp://a:7300, tcp://b:7300"})
    Config.from_dict({"mode": "standalone", "pool": "ipc:///run/kvtier/pool.sock", "pool_transport": "shm"})
    Config.from_dict({"mode": "distributed", "pool": "tcp://a:7400", "pool_transport": "stream"})


@pytest.mark.parametrize("values,key", [
    ({"dram_capacity": 4095}, "dram_capacity"),
    ({"ssd_path": "SSD", "ssd_capacity": 4000}, "ssd_capacity"),
    ({"ssd_path": "SSD", "ssd_capacity": 4097 + 100, "ssd_direct_io": "true"}, "ssd_capacity"),  # 8 KiB O_DIRECT slots
    ({"mode": "distributed", "pool": "POOL", "pool_staging_bytes": 1000}, "pool_staging_bytes"),
    ({"mode": "distributed", "pool": "POOL", "ssd_path": "SSD", "ssd_capacity": 100}, "ssd_capacity"),
])
def test_a_size_that_holds_no_block_fails_before_any_tier_is_built(tmp_path, values, key):
    # The pool endpoint listens nowhere and the SSD directory does not exist: a tier built before the check
    # would leave a pool tier's threads running (or make the directory).
    import socket
    import threading

    from kvtier.store import TieredStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        pool = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ssd = tmp_path / "ssd"
    values = {k: (str(ssd) if v == "SSD" else pool if v == "POOL" else v) for k, v in values.items()}
    threads = set(threading.enumerate())
    with pytest.raises(ConfigError, match=rf"^{key}: \d+ B holds no block of \d+ B"):
        TieredStore.from_config(values, 4097)
    assert not ssd.exists()
    assert not [t for t in threading.enumerate() if t not in threads and t.name.startswith("kvtier")]


def test_sizes_that_hold_a_block_build():
    from kvtier.store import TieredStore

    with TieredStore.from_config({"dram_capacity": 4097}, 4097) as store:
        assert store.tiers[0].stats().capacity_bytes == 4097  # exactly one block: accepted


# ---- each tier's section owns its keys (kvtier/settings/, issue 16 item 6) ------------------------------------

SECTIONS = ("DramKeys", "SsdKeys", "PoolKeys", "StoreKeys")


def test_config_is_the_sections_keys_each_owned_once():
    import kvtier.settings as settings

    owned = [f.name for name in SECTIONS for f in fields(getattr(settings, name))]
    assert len(owned) == len(set(owned)), "a key declared by two sections"
    assert [f.name for f in fields(Config)] == owned  # nothing of Config's own; DRAM, SSD, pool, store order


@pytest.mark.parametrize("values,match", [
    ({"copy_threads": 17}, r"^copy_threads must be in 0\.\.16 \(0: by measured rate\), got 17$"),  # DramKeys
    ({"eviction": "lfu"}, r"^eviction: unknown eviction policy 'lfu'"),  # DramKeys
    ({"ssd_io_threads": 0}, r"^ssd_io_threads must be in 1\.\.64, got 0$"),  # SsdKeys
    ({"ssd_path": "/x", "ssd_capacity": 0}, r"^ssd_capacity must be > 0, got 0$"),  # SsdKeys
    ({"pool_copy_threads": 17}, r"^pool_copy_threads must be in 0\.\.16 \(0: by measured rate\), got 17$"),  # PoolKeys
    ({"mode": "standalone"}, r"^mode 'standalone' needs exactly one 'pool' endpoint"),  # PoolKeys
    ({"mode": "standalone", "pool": "ipc:///p", "ssd_path": "/x"}, r"^mode 'standalone' keeps no SSD tier"),  # both
    ({"io_threads": 257}, r"^io_threads must be in 1\.\.256, got 257$"),  # StoreKeys
    ({"close_timeout_s": -1}, r"^close_timeout_s must be in 0\.\.3600, got -1\.0$"),  # StoreKeys
])
def test_validate_asks_every_section(values, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_dict(values)


@pytest.mark.parametrize("values,block,key", [
    ({"mode": "standalone", "pool": "ipc:///p", "dram_capacity": 10}, 4096, None),  # dram_capacity unused there
    ({"mode": "standalone", "pool": "ipc:///p", "standalone_dram_capacity": 10}, 4096, "standalone_dram_capacity"),
    ({"pool_staging_bytes": 10}, 4096, None),  # embedded: no pool, its staging unused
    ({"ssd_capacity": 10}, 4096, None),  # no ssd_path: no SSD tier
    ({"ssd_path": "/x", "ssd_capacity": 4096}, 4096, None),
    ({"ssd_path": "/x", "ssd_capacity": 4096, "ssd_direct_io": "true"}, 4095, None),  # one 4 KiB slot
    ({"ssd_path": "/x", "ssd_capacity": 4096, "ssd_direct_io": "true"}, 4097, "ssd_capacity"),
])
def test_block_sizes_count_only_the_keys_the_mode_uses(values, block, key):
    c = Config.from_dict(values)
    if key is None:
        c.check_block_bytes(block)
    else:
        with pytest.raises(ConfigError, match=rf"^{key}: "):
            c.check_block_bytes(block)


def test_importing_the_config_loads_no_tier_and_no_torch():
    import subprocess
    import sys

    code = ("import sys, kvtier.settings, kvtier.config; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('kvtier.tiers.dram')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
