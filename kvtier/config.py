"""One Config dataclass for the embedded store, loadable from a dict, a JSON/TOML file or KVTIER_* variables.

The dict form is the one a vLLM user writes in ``kv_connector_extra_config`` and an SGLang user in
``--hicache-storage-backend-extra-config``. Keys are flat and snake_case; an unknown key is an error that
names it (and the closest known keys), so a typo never silently falls back to a default.

Precedence, lowest first: defaults < file (``KVTIER_CONFIG`` or an explicit path) < ``KVTIER_*`` variables
< the explicit dict.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvtier.units import parse_bytes

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ENV_PREFIX = "KVTIER_"
ENV_CONFIG_FILE = "KVTIER_CONFIG"  # names a file; not a config key itself
# KVTIER_* variables that are not config keys. ``from_env`` skips exactly these, so a typo of a real key is
# still an error; a new non-config variable must be named here (tests/test_config.py scans the tree for them).
ENV_CACHE_DIR = "KVTIER_CACHE_DIR"  # where native_build.py caches the compiled CUDA library
ENV_CUDA_ARCH = "KVTIER_CUDA_ARCH"  # GPU architectures native_build.py compiles for when none is visible
ENV_NATIVE_CPU = "KVTIER_NATIVE_CPU"  # "0": hostcopy.py and master/table.py skip the native CPU library
ENV_RDMA_DEVICE = "KVTIER_RDMA_DEVICE"  # name[:port[:gid_index]]: the device kvtier/transport/rdma.py opens
ENV_ENGINE_PYTHON = "KVTIER_ENGINE_PYTHON"  # the real vLLM engine's python for bench/engine_proc.py (tests, bench)
ENV_NOT_CONFIG = frozenset({ENV_CONFIG_FILE, ENV_CACHE_DIR, ENV_CUDA_ARCH, ENV_NATIVE_CPU, ENV_RDMA_DEVICE,
                            ENV_ENGINE_PYTHON})


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names it."""


def _bytes_field(default: int | str, help: str) -> Any:
    return field(default=parse_bytes(default), metadata={"kind": "bytes", "help": help})


def _field(default: Any, help: str, choices: tuple[str, ...] = (), kind: str = "") -> Any:
    metadata: dict[str, Any] = {"help": help, "choices": choices}
    if kind:
        metadata["kind"] = kind
    return field(default=default, metadata=metadata)


def _switch_field(default: str, help: str) -> Any:
    """auto, true or false; any boolean word (or a JSON boolean) is read as true/false."""
    return _field(default, help, ("auto", "true", "false"), kind="switch")


@dataclass
class Config:
    """Settings of one embedded TieredStore (and the connectors built on it)."""

    # Host DRAM tier.
    dram_capacity: int = _bytes_field("4GiB", "bytes of host DRAM for packed blocks, allocated once")
    dram_shm_path: str = _field("", "back the DRAM buffer with this file (e.g. /dev/shm/kvtier) so "
                                    "other processes can map it; empty: private memory")
    dram_pin_memory: str = _switch_field("auto", "page-lock the DRAM buffer for fast GPU copies: auto (when CUDA "
                                                 "is present), true, false")
    dram_prefault: bool = _field(False, "touch every page of the DRAM buffer at start-up, so the first "
                                        "puts pay no page faults (costs ~0.1 s per GiB at start)")
    eviction: str = _field("default", "DRAM eviction policy: default (the session-aware predictor, pnu), lru, "
                                      "fifo, s3fifo, arc, chain-lru, or an import path 'package.module:Class'")
    copy_threads: int = _field(1, "threads per batched host copy (1 keeps one core free for the engine)")
    io_threads: int = _field(4, "threads serving the *_async calls")

    # Local SSD tier under DRAM (kvtier/tiers/ssd.py); off while ssd_path is empty.
    ssd_path: str = _field("", "directory for the SSD tier's segment files and index (on a local disk; reopened "
                               "after a restart, its blocks are served again); empty: no SSD tier")
    ssd_capacity: int = _bytes_field("64GiB", "most bytes of block data the SSD tier keeps on disk")
    ssd_offload: str = _field("on_evict", "when blocks go from DRAM to SSD: write_through (every put), on_evict "
                                          "(when DRAM evicts them), second_hit (on eviction, if seen twice)",
                              ("write_through", "on_evict", "second_hit"))
    ssd_promote: bool = _field(True, "copy a block served from SSD into DRAM too")
    ssd_eviction: str = _field("default", "SSD eviction policy: default (pnu, told what the engine knows, as "
                                          "DRAM's), lru, fifo, s3fifo, arc, chain-lru, or an import path")
    ssd_direct_io: str = _switch_field("auto", "O_DIRECT for SSD I/O: auto (fall back to buffered I/O, with one "
                                               "warning, where the filesystem lacks it), true, false")
    ssd_fsync: bool = _field(True, "fsync data and index at the end of each SSD write batch (crash-durable); "
                                   "false keeps checksums but may lose the last writes to a machine crash")
    ssd_segment_bytes: int = _bytes_field("256MiB", "size of each SSD segment file")
    ssd_staging_bytes: int = _bytes_field("256MiB", "host memory for blocks queued for the SSD (write-behind); "
                                                    "0 writes offloads synchronously on the caller's thread")
    ssd_io_threads: int = _field(4, "threads doing the SSD tier's preadv/pwritev")
    close_timeout_s: float = _field(30.0, "on close (an engine's clean shutdown), write DRAM's blocks that the "
                                          "lower tiers would get on eviction (on_evict: every block the SSD lacks) "
                                          "for at most this long; the rest is lost with the process (logged)")

    # Modes: where the store's DRAM lives (README "Modes"). The remote/node pool is kvtier-pool.
    mode: str = _field("embedded", "embedded: private DRAM (+SSD) in this process; standalone: the node pool "
                                   "(kvtier-pool on this host, shared by its engine processes) is the store's "
                                   "DRAM; distributed: private DRAM, remote pools below it (+SSD below them)",
                       ("embedded", "standalone", "distributed"))
    pool: str = _field("", "pool endpoint(s), comma-separated: standalone: the node pool's ipc:///path; "
                           "distributed without a master: each pool's tcp://host:port")
    master: str = _field("", "distributed: kvtier-master endpoint; it places blocks in pools and says which "
                             "pool holds what (then 'pool' is not needed)")
    node_id: str = _field("", "this engine's name with the master (default host-pid)")
    pool_transport: str = _field("auto", "how blocks move to and from pools: auto (shm for ipc://; for tcp:// "
                                         "rdma when both ends have a device, else stream), stream (raw TCP "
                                         "received in place), tcp (zmq frames), rdma, shm",
                                 ("auto", "stream", "tcp", "rdma", "shm"))
    pool_timeout_ms: int = _field(500, "a pool silent this long turns the call's blocks into misses (the "
                                       "engine recomputes) and is skipped for a back-off")
    pool_connections: int = _field(4, "parallel connections per pool for big batches")
    pool_copy_threads: int = _field(0, "threads per shared-memory copy to/from a pool on this host (shm "
                                       "transport): 0 = auto (2 for a batch of 1 MiB or more while a core is "
                                       "spare, else 1)")
    pool_offload: str = _field("write_through", "when blocks go from private DRAM to the pool: write_through "
                                                "(every put: other nodes see them at once), on_evict, second_hit",
                               ("write_through", "on_evict", "second_hit"))
    pool_promote: str = _switch_field("auto", "copy a block served from a pool into private DRAM too: true, "
                                              "false, or auto (as ssd_promote, which also switched this before "
                                              "pool_promote existed)")
    pool_staging_bytes: int = _bytes_field("256MiB", "host memory for blocks queued for the pool "
                                                     "(write-behind); 0 sends on the caller's thread")
    auth_dir: str = _field("", "CurveZMQ keys for a master and pools started with --auth-dir: this client's "
                               "client.key_secret and the daemons' server.key (or servers/<endpoint>.key); "
                               "empty: plain zmq (README 'Authenticated sockets')")
    standalone_dram_capacity: int = _bytes_field(0, "standalone: a private DRAM tier above the node pool "
                                                    "(0: none, the node pool is the top tier)")

    # Namespace (used by connectors and the CLI when they make keys).
    model: str = _field("", "model id folded into every key's namespace")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], base: Config | None = None) -> Config:
        """A Config with ``values`` applied over ``base`` (or the defaults). Unknown keys are errors."""
        known = {f.name: f for f in fields(cls)}
        unknown = [k for k in values if k not in known]
        if unknown:
            raise ConfigError("; ".join(_unknown_key_message(k, known) for k in unknown))
        config = dataclasses.replace(base) if base is not None else cls()
        for key, raw in values.items():
            setattr(config, key, coerce_value(key, field_kind(known[key]), raw))
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], base: Config | None = None) -> Config:
        """Load a .json or .toml file whose top level holds config keys (or a [kvtier] table)."""
        p = Path(path)
        try:
            text = p.read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read config file {p}: {e.strerror}") from None
        try:
            data = tomllib.loads(text.decode()) if p.suffix == ".toml" else json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {p} is not valid {p.suffix.lstrip('.') or 'JSON'}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p}: the top level must be a table/object")
        data = data.get("kvtier", data)
        try:
            return cls.from_dict(data, base)
        except ConfigError as e:
            raise ConfigError(f"config file {p}: {e}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, base: Config | None = None) -> Config:
        """Apply KVTIER_<KEY> variables (e.g. KVTIER_DRAM_CAPACITY=64GiB) over ``base``; the variables of
        ENV_NOT_CONFIG (a file path, build and library switches) are not keys and are skipped."""
        environ = os.environ if environ is None else environ
        values = {k[len(ENV_PREFIX):].lower(): v for k, v in environ.items()
                  if k.startswith(ENV_PREFIX) and k not in ENV_NOT_CONFIG}
        try:
            return cls.from_dict(values, base)
        except ConfigError as e:
            raise ConfigError(f"environment: {e} (variables are {ENV_PREFIX}<KEY>)") from None

    @classmethod
    def load(
        cls, source: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Config:
        """Defaults < file < KVTIER_* variables < ``source`` (a dict, a file path, or a Config as is)."""
        if isinstance(source, Config):
            return source
        environ = os.environ if environ is None else environ
        config = cls()
        if environ.get(ENV_CONFIG_FILE):
            config = cls.from_file(environ[ENV_CONFIG_FILE], config)
        if isinstance(source, (str, os.PathLike)):
            config = cls.from_file(source, config)
        config = cls.from_env(environ, config)
        if isinstance(source, Mapping):
            config = cls.from_dict(source, config)
        return config

    def validate(self) -> None:
        """Raise ConfigError naming the first bad value, so every mistake a tier would refuse when it is built
        fails here, when the config is loaded (a vLLM scheduler, an SGLang server start), not in the workers."""
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f"{f.name}: {getattr(self, f.name)!r} is not one of {', '.join(choices)}")
        if self.dram_capacity <= 0:
            raise ConfigError(f"dram_capacity must be > 0, got {self.dram_capacity}")
        if not 1 <= self.copy_threads <= 16:
            raise ConfigError(f"copy_threads must be in 1..16, got {self.copy_threads}")
        if not 1 <= self.io_threads <= 256:
            raise ConfigError(f"io_threads must be in 1..256, got {self.io_threads}")
        if self.ssd_path and self.ssd_capacity <= 0:
            raise ConfigError(f"ssd_capacity must be > 0, got {self.ssd_capacity}")
        if self.ssd_segment_bytes <= 0:
            raise ConfigError(f"ssd_segment_bytes must be > 0, got {self.ssd_segment_bytes}")
        if not 1 <= self.ssd_io_threads <= 64:
            raise ConfigError(f"ssd_io_threads must be in 1..64, got {self.ssd_io_threads}")
        if not 0 <= self.close_timeout_s <= 3600:
            raise ConfigError(f"close_timeout_s must be in 0..3600, got {self.close_timeout_s}")
        self._validate_policies()
        self._validate_mode()

    # Keys naming an eviction policy (kvtier.policies' registry: a registered name, ``default``, or an import
    # path), checked by resolving them as the tiers will.
    POLICY_KEYS = ("eviction", "ssd_eviction")

    def _validate_policies(self) -> None:
        for key in self.POLICY_KEYS:
            check_policy_name(key, getattr(self, key))

    def check_block_bytes(self, block_bytes: int) -> None:
        """ConfigError naming the key whose size holds no block of ``block_bytes`` (known once the layout is):
        what TieredStore.from_config checks before it builds any tier, so none is left half built (a pool
        tier's connections and threads, an SSD directory) by a later tier's refusal."""
        if block_bytes <= 0:
            raise ConfigError(f"a block must have > 0 bytes, got {block_bytes}")
        dram_key = "standalone_dram_capacity" if self.mode == "standalone" else "dram_capacity"
        sizes = [(dram_key, getattr(self, dram_key), block_bytes)]
        if self.mode != "embedded" and self.pool_staging_bytes:
            sizes.append(("pool_staging_bytes", self.pool_staging_bytes, block_bytes))
        if self.ssd_path:
            # O_DIRECT slots are rounded up to 4 KiB; auto may fall back to buffered I/O, so only true rounds here.
            slot = -(-block_bytes // 4096) * 4096 if self.ssd_direct_io == "true" else block_bytes
            sizes.append(("ssd_capacity", self.ssd_capacity, slot))
        for key, value, need in sizes:
            if value and value < need:  # 0: no such tier/staging (a standalone store without private DRAM)
                raise ConfigError(f"{key}: {value} B holds no block of {need} B (one block of this layout)")

    @property
    def pool_promotes(self) -> bool:
        """Whether blocks served from a pool are copied into private DRAM (``pool_promote``; auto: ssd_promote)."""
        return self.ssd_promote if self.pool_promote == "auto" else self.pool_promote == "true"

    def _validate_mode(self) -> None:
        if not 1 <= self.pool_timeout_ms <= 60_000:
            raise ConfigError(f"pool_timeout_ms must be in 1..60000, got {self.pool_timeout_ms}")
        if not 1 <= self.pool_connections <= 64:
            raise ConfigError(f"pool_connections must be in 1..64, got {self.pool_connections}")
        if not 0 <= self.pool_copy_threads <= 16:
            raise ConfigError(f"pool_copy_threads must be in 0..16 (0: by batch size), got {self.pool_copy_threads}")
        pools = [e.strip() for e in self.pool.split(",") if e.strip()]
        bad = [e for e in pools if not e.startswith(("tcp://", "ipc://"))]
        if bad:
            raise ConfigError(f"pool: {bad[0]!r} is not a tcp://host:port or ipc:///path endpoint")
        masters = [e.strip() for e in self.master.split(",") if e.strip()]
        bad = [e for e in masters if not e.startswith(("tcp://", "ipc://"))]
        if bad:  # else the workers' zmq connect fails when the pool tier is built
            raise ConfigError(f"master: {bad[0]!r} is not a tcp://host:port or ipc:///path endpoint")
        remote = [e for e in pools if not e.startswith("ipc://")]
        if self.pool_transport == "shm" and remote:  # a pool offers shared memory only on an ipc:// endpoint
            raise ConfigError(f"pool_transport: 'shm' maps a pool on this host, reached at an ipc:///path endpoint; "
                              f"pool lists {remote[0]!r} (use auto, stream, tcp or rdma for it)")
        if self.mode == "embedded" and (pools or self.master):
            raise ConfigError("pool/master are set but mode is 'embedded' (set mode to standalone or distributed)")
        if self.mode == "standalone":
            if len(pools) != 1:
                raise ConfigError("mode 'standalone' needs exactly one 'pool' endpoint: the node pool, e.g. "
                                  "ipc:///run/kvtier/pool.sock")
            if self.ssd_path:
                raise ConfigError("mode 'standalone' keeps no SSD tier in the engine (ssd_path is set)")
        if self.mode == "distributed" and not (pools or self.master):
            raise ConfigError("mode 'distributed' needs 'master' (kvtier-master) or 'pool' (a list of pools)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def describe(cls) -> list[tuple[str, str, str]]:
        """(key, default, help) for every key: what ``kvtier config`` prints."""
        return [(f.name, repr(f.default), f.metadata.get("help", "")) for f in fields(cls)]


def check_policy_name(key: str, spec: Any) -> None:
    """ConfigError naming ``key``, ``spec`` and the known policies unless ``spec`` names an eviction policy (a
    registered name, ``default``, or an import path 'package.module:Class' that imports)."""
    from kvtier.policies import known_policies, policy_class  # here: importing config must stay light

    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{key}: expected an eviction policy name, got {spec!r}; known: "
                          f"{', '.join(known_policies())} (or an import path 'package.module:Class')")
    try:
        cls = policy_class(spec)
    except ValueError as e:  # the registry's message names the known policies, or why an import path failed
        raise ConfigError(f"{key}: {e}") from None
    if not callable(cls):
        raise ConfigError(f"{key}: {spec!r} is not a policy class (got a {type(cls).__name__})")


def _unknown_key_message(key: str, known: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(known), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known keys: {', '.join(known)}"
    return f"unknown config key {key!r}{hint}"


# One set of boolean words for every key kvtier reads (store keys, the vLLM connector's, the SGLang backend's),
# from a dict, a file or a KVTIER_* variable; case and surrounding blanks do not matter. JSON/TOML booleans and
# the integers 0 and 1 are accepted as themselves.
TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")
_BOOL_WORDS = ", ".join(f"{t}/{f}" for t, f in zip(TRUE_WORDS, FALSE_WORDS))


def parse_bool(key: str, raw: Any) -> bool:
    """``raw`` as a boolean, or ConfigError naming ``key`` and the words accepted."""
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, int) and raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str):
        word = raw.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise ConfigError(f"{key}: expected a boolean ({_BOOL_WORDS}), got {raw!r}")


def coerce_value(key: str, kind: str, raw: Any) -> Any:
    """Turn a dict/env/TOML value into ``kind`` or raise ConfigError naming ``key``. Kinds: bool, int, float,
    str, bytes (a size such as "64GiB", kvtier.units.parse_bytes) and switch (``auto`` or a boolean word,
    normalised to "auto", "true" or "false"); any other kind passes ``raw`` through."""
    if kind == "bool":
        return parse_bool(key, raw)
    if kind == "switch":
        if isinstance(raw, str) and raw.strip().lower() == "auto":
            return "auto"
        try:
            return "true" if parse_bool(key, raw) else "false"
        except ConfigError:
            raise ConfigError(f"{key}: {raw!r} is not one of auto, true, false (or a boolean word: {_BOOL_WORDS})"
                              ) from None
    try:
        if kind == "bytes":
            return parse_bytes(raw)
        if kind == "int":
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(f"expected an integer, got {raw!r}")
            return int(raw)
        if kind == "float":
            if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
                raise ValueError(f"expected a number, got {raw!r}")
            return float(raw)
        if kind == "str":
            if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
                raise ValueError(f"expected a string, got {type(raw).__name__}")
            return str(raw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {e}") from None
    return raw


def field_kind(f: dataclasses.Field[Any]) -> str:
    """The coercion kind of a dataclass field: its metadata's ``kind`` (bytes, switch), else its type's name."""
    kind = f.metadata.get("kind")
    if kind:
        return str(kind)
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def coerce_fields(cls: type[Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (keys of the dataclass ``cls``) coerced to its fields' kinds: what the connectors' settings use,
    so their keys accept exactly what Config's do."""
    known = {f.name: f for f in fields(cls)}
    return {k: coerce_value(k, field_kind(known[k]), v) for k, v in values.items()}
