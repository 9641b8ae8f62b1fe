"""One Config dataclass for the embedded store (each tier's keys declared and checked by its section in
kvtier/settings/), loadable from a dict, a JSON/TOML file or KVTIER_* variables.

The dict form is the one a vLLM user writes in ``kv_connector_extra_config`` and an SGLang user in
``--hicache-storage-backend-extra-config``. Keys are flat and snake_case; an unknown key is an error that
names it (and the closest known keys), so a typo never silently falls back to a default.

Precedence, lowest first: defaults < file (``KVTIER_CONFIG`` or an explicit path) < ``KVTIER_*`` variables
< the explicit dict. ``Config.load`` merges the layers first and validates the result once: a layer need not be
valid alone (``KVTIER_POOL`` in the environment with ``{"mode": "standalone"}`` in the dict is one valid config),
while an unknown key or a value of the wrong kind is refused naming the layer it came from. A process loads its
config once and hands the Config object down (the connectors: ``split_extra_config``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvtier.envvars import ENV_CONFIG_FILE, ENV_NOT_CONFIG
from kvtier.settings import ConfigError, DramKeys, PoolKeys, SsdKeys, StoreKeys
from kvtier.units import parse_bytes

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ENV_PREFIX = "KVTIER_"  # KVTIER_<KEY>; the variables that are not keys (ENV_NOT_CONFIG) are kvtier/envvars.py's


@dataclass
class Config(StoreKeys, PoolKeys, SsdKeys, DramKeys):
    """Settings of one embedded TieredStore (and the connectors built on it): one flat object whose keys each
    tier's section declares and checks (kvtier/settings/: DramKeys, SsdKeys, PoolKeys, StoreKeys). A dataclass
    takes its bases' fields last base first, so the keys read DRAM, SSD, pool and mode, then the store's own.
    Pure data; checked whole by ``validate`` (every loader calls it)."""

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], base: Config | None = None) -> Config:
        """A Config with ``values`` applied over ``base`` (or the defaults), validated. Unknown keys are errors."""
        config = dataclasses.replace(base) if base is not None else cls()
        config._apply(values)
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], base: Config | None = None) -> Config:
        """Load a .json or .toml file whose top level holds config keys (or a [kvtier] table), validated."""
        return cls._loaded([_file_layer(path)], base)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, base: Config | None = None) -> Config:
        """Apply KVTIER_<KEY> variables (e.g. KVTIER_DRAM_CAPACITY=64GiB) over ``base``, validated; the variables
        of ENV_NOT_CONFIG (a file path, build and library switches) are not keys and are skipped."""
        return cls._loaded([_env_layer(os.environ if environ is None else environ)], base)

    @classmethod
    def load(
        cls, source: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Config:
        """Defaults < file < KVTIER_* variables < ``source`` (a dict, a file path, or a Config as is): the layers
        merged, then validated once (ConfigError naming the layers the merged values came from)."""
        if isinstance(source, Config):
            return source
        environ = os.environ if environ is None else environ
        layers: list[Layer] = []
        if environ.get(ENV_CONFIG_FILE):
            layers.append(_file_layer(environ[ENV_CONFIG_FILE]))
        if isinstance(source, (str, os.PathLike)):
            layers.append(_file_layer(source))
        layers.append(_env_layer(environ))
        if isinstance(source, Mapping):
            layers.append(Layer("the dict", dict(source)))
        return cls._loaded(layers)

    @classmethod
    def _loaded(cls, layers: list[Layer], base: Config | None = None) -> Config:
        """``layers`` applied over ``base`` (or the defaults) in order, then validated once. A layer's unknown key
        or badly typed value is refused naming that layer; a merged config that fails validation (a value, or a
        rule between keys that may come from different layers) is refused naming every layer and the keys it
        set, so the source of each value is in the message."""
        config = dataclasses.replace(base) if base is not None else cls()
        for layer in layers:
            try:
                config._apply(layer.values)
            except ConfigError as e:
                raise ConfigError(f"{layer.name}: {e}{layer.hint}") from None
        try:
            config.validate()
        except ConfigError as e:
            named = [f"{layer.name} ({', '.join(layer.values)})" for layer in layers if layer.values]
            raise ConfigError(f"{e} [keys set by: {'; '.join(named) or 'nothing: the defaults'}]") from None
        return config

    def _apply(self, values: Mapping[str, Any]) -> None:
        """Set ``values`` (coerced to each key's kind), unvalidated; ConfigError for an unknown key or a bad
        value, before anything is set."""
        known = {f.name: f for f in fields(self)}
        unknown = [k for k in values if k not in known]
        if unknown:
            raise ConfigError("; ".join(_unknown_key_message(k, known) for k in unknown))
        coerced = {key: coerce_value(key, field_kind(known[key]), raw) for key, raw in values.items()}
        for key, value in coerced.items():
            setattr(self, key, value)

    def validate(self) -> None:
        """Raise ConfigError naming the first bad value, so every mistake a tier would refuse when it is built
        fails here, when the config is loaded (a vLLM scheduler, an SGLang server start), not in the workers:
        every key's choices, then each section's own checks, then the rules between sections."""
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f"{f.name}: {getattr(self, f.name)!r} is not one of {', '.join(choices)}")
        self.check_dram_keys()
        self.check_ssd_keys()
        self.check_pool_keys()
        self.check_store_keys()
        if self.mode == "standalone" and self.ssd_path:
            raise ConfigError("mode 'standalone' keeps no SSD tier in the engine (ssd_path is set)")

    def check_block_bytes(self, block_bytes: int) -> None:
        """ConfigError naming the key whose size holds no block of ``block_bytes`` (known once the layout is):
        what TieredStore.from_config checks before it builds any tier, so none is left half built (a pool
        tier's connections and threads, an SSD directory) by a later tier's refusal. Each section names its
        sizes; dram_capacity counts only where it sizes the DRAM tier (not standalone: standalone_dram_capacity)."""
        if block_bytes <= 0:
            raise ConfigError(f"a block must have > 0 bytes, got {block_bytes}")
        sizes = [] if self.mode == "standalone" else self.dram_block_sizes(block_bytes)
        sizes += self.pool_block_sizes(block_bytes) + self.ssd_block_sizes(block_bytes)
        for key, value, need in sizes:
            if value and value < need:  # 0: no such tier/staging (a standalone store without private DRAM)
                raise ConfigError(f"{key}: {value} B holds no block of {need} B (one block of this layout)")

    @property
    def private_dram_capacity(self) -> int:
        """Bytes of the private DRAM tier this mode builds (0: none; standalone: standalone_dram_capacity)."""
        return self.standalone_dram_capacity if self.mode == "standalone" else self.dram_capacity

    @property
    def dram_admits(self) -> bool:
        """Whether a full DRAM tier may decline a put's new blocks (``dram_admission``): where it is the last tier
        always; "every" above any lower tier too; "auto" also above an SSD that is its only lower tier (embedded
        mode), not above a pool (replay, docs/prefetch.md 'Between turns': with prefetch on, declining above an
        SSD raised the hit rate from 0.933 to 0.943 and cut TTFT p50 from 10.19 to 8.47 s; above a pool it cost
        0.4 points and raised TTFT)."""
        if self.dram_admission == "every":
            return True
        last = self.mode == "embedded" and not self.ssd_path
        return last or (self.dram_admission == "auto" and self.mode == "embedded")

    @property
    def pool_promotes(self) -> bool:
        """Whether blocks served from a pool are copied into private DRAM (``pool_promote``; auto: ssd_promote)."""
        return self.ssd_promote if self.pool_promote == "auto" else self.pool_promote == "true"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def describe(cls) -> list[tuple[str, str, str]]:
        """(key, default, help) for every key: what ``kvtier config`` prints."""
        return [(f.name, repr(f.default if f.default is not dataclasses.MISSING else f.default_factory()),
                 f.metadata.get("help", "")) for f in fields(cls)]


@dataclass(frozen=True)
class Layer:
    """One source of config values (a file, the environment, a dict): what ``Config.load`` merges, named in its
    errors."""

    name: str
    values: dict[str, Any]
    hint: str = ""  # appended to an error of this layer (how its keys are spelled)


def _file_layer(path: str | os.PathLike[str]) -> Layer:
    """The keys of a .json or .toml file whose top level holds config keys (or a [kvtier] table)."""
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
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: [kvtier] must be a table/object")
    return Layer(f"config file {p}", data)


def _env_layer(environ: Mapping[str, str]) -> Layer:
    """The KVTIER_<KEY> variables, as keys; those of ENV_NOT_CONFIG (a file path, build and library switches)
    are not keys and are skipped."""
    values = {k[len(ENV_PREFIX):].lower(): v for k, v in environ.items()
              if k.startswith(ENV_PREFIX) and k not in ENV_NOT_CONFIG}
    return Layer("environment", values, f" (variables are {ENV_PREFIX}<KEY>)")


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
    str, bytes (a size such as "64GiB", kvtier.units.parse_bytes), mapping (a table, or JSON text) and switch
    (``auto`` or a boolean word, normalised to "auto", "true" or "false"); any other kind passes ``raw`` through."""
    if kind == "bool":
        return parse_bool(key, raw)
    if kind == "mapping":
        if isinstance(raw, str):  # a KVTIER_* variable: JSON text
            try:
                raw = json.loads(raw)
            except ValueError as e:
                raise ConfigError(f"{key}: not JSON: {e}") from None
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{key}: expected a table, got {type(raw).__name__}")
        return {str(k): v for k, v in raw.items()}
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
