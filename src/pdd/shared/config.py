"""One config file (YAML) for a whole deployment: sites, instances, model, transports, policies.

Every service reads the same file and picks its own instance by id. Any field can be overridden
by an environment variable ``PDD__SECTION__FIELD`` (double underscores separate levels), e.g.
``PDD__NATS__URL=nats://10.0.0.5:4222`` or ``PDD__POLICY__WAN_MASKING_THRESHOLD_S=0.5``; pydantic-settings
reads them (lists and maps as JSON, an empty value is null) and they win over the file's values.
Validation happens at start and names the field and the fix (``pdd config check F``).

Why one module: the schema, how it is read (file, then env) and how it is printed (redacted) change
together; split, a new secret field could be read in one place and leak from another.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)
from pydantic_settings.sources.utils import parse_env_vars

from pdd.shared.engines import DEFAULT_ENGINE, EnginePlugin, engine_plugin, engine_plugins
from pdd.shared.links import KVLink
from pdd.shared.pipelines import HandoffMode, Pipeline, routable
from pdd.shared.policy import PolicyConfig
from pdd.shared.protocol import check_token
from pdd.shared.roles import Role

ENV_PREFIX = "PDD__"


class ConfigError(ValueError):
    """A config file is missing, unparsable or invalid; the message lists each field and its fix."""


class ConfigWarning(UserWarning):
    """A config key that is valid but has no effect here (a known key the chosen engine backend ignores)."""


def engine_keys(config: "PDDConfig") -> tuple[EnginePlugin, list[str]]:
    """(the chosen backend, the keys set for other backends only). Raises ``ValueError`` naming a ``model.*`` key
    or a top-level section that no installed backend knows."""
    plugins = engine_plugins()
    plugin = engine_plugin(config.model.backend)
    ignored, unknown = [], []
    for key in config.model.model_extra or {}:
        if key in plugin.model_settings.model_fields:
            continue
        owners = [p.name for p in plugins.values() if key in p.model_settings.model_fields]
        (ignored if owners else unknown).append(f"model.{key}")
    for section in config.model_extra or {}:
        if section == plugin.section:
            continue
        owners = [p.name for p in plugins.values() if p.section == section]
        (ignored if owners else unknown).append(section)
    if unknown:
        known = sorted({f"model.{k}" for p in plugins.values() for k in p.model_settings.model_fields}
                       | {p.section for p in plugins.values() if p.section})
        raise ValueError(f"{', '.join(unknown)}: unknown field; check the spelling (no engine backend knows it: "
                         f"{', '.join(sorted(plugins))}; their keys: {', '.join(known)})")
    return plugin, ignored


class _Strict(BaseModel):
    model_config = {"extra": "forbid"}


class ModelConfig(_Strict):
    """What every engine backend reads: the model, the pool's block size and the scheduler's limits. A backend's own
    keys sit beside these, flat (``model.dtype``, ``model.batch_invariant``, ...): its ``EnginePlugin`` declares
    them (shared/engines.py) and the config validates them against the chosen backend when it loads."""

    model_config = {"extra": "allow"}

    backend: str = Field(
        DEFAULT_ENGINE, description="the engine backend, an entry point of the 'pdd.engines' group: torch (real "
                                    "weights and math, the embedded engine), emulated (no weights, step times from "
                                    "the cost model of the 'emulation' section's chips, oracle tokens), vllm (vLLM "
                                    "embedded in each role, KV through PDD's connector; docs/BACKENDS.md)")
    path: str = Field("default", description="'default' (built-in SmolLM2-135M-Instruct), a HF folder or a .gguf "
                                             "file; the emulated backend reads only its tokenizer (vocabulary, EOS)")
    name: str | None = Field(None, description="model name served by the API; defaults to the path's basename")
    block_size: int = Field(16, ge=1, le=1024)
    max_num_seqs: int = Field(64, ge=1)
    max_prefill_tokens: int = Field(2048, ge=16, description="tokens one engine step prefills or extends, all "
                                                           "requests together")
    enable_prefix_cache: bool = Field(True, description="radix prefix cache (P) / Decode-side RadixCache (MD)")

    @field_validator("backend")
    @classmethod
    def _installed(cls, value: str) -> str:
        engine_plugin(value)  # a ValueError lists the installed backends
        return value

    @property
    def served_name(self) -> str:
        """The name /v1/models lists, and the ``model_name`` label of every vLLM-named metric."""
        if self.name:
            return self.name
        if self.path == "default":
            return "SmolLM2-135M-Instruct"
        return self.path.rstrip("/").split("/")[-1]


def _readable_file(field: str, value: str | None) -> str | None:
    """A path the process must read at start: fail at config time, naming the field and the path."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"file not found: {path} (fix the path or unset {field})")
    if not os.access(path, os.R_OK):
        raise ValueError(f"file not readable by this user: {path}")
    return str(path)


class NatsTlsConfig(_Strict):
    """TLS to the NATS servers. Any field set (or a tls:// URL) makes the connection TLS-only."""

    ca_file: str | None = Field(None, description="PEM CA bundle that signed the servers' certificates "
                                                  "(default: the system's trust store)")
    cert_file: str | None = Field(None, description="PEM client certificate (servers with `verify: true`)")
    key_file: str | None = Field(None, description="PEM private key of cert_file")
    hostname: str | None = Field(None, description="name to verify the server certificate against "
                                                   "(default: the host in nats.url)")
    verify: bool = Field(True, description="verify the server's certificate; false only for experiments")

    @field_validator("ca_file", "cert_file", "key_file")
    @classmethod
    def _exists(cls, value: str | None, info: Any) -> str | None:
        return _readable_file(f"nats.tls.{info.field_name}", value)

    @model_validator(mode="after")
    def _pair(self) -> "NatsTlsConfig":
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("nats.tls: cert_file and key_file go together; set both or neither")
        return self

    @property
    def enabled(self) -> bool:
        return any((self.ca_file, self.cert_file, self.hostname)) or not self.verify


class NatsConfig(_Strict):
    url: str = "nats://127.0.0.1:4222"
    token: str | None = None
    user: str | None = None
    password: str | None = None
    nkey_seed_file: str | None = Field(None, description="file holding this service's NKey seed (SU...); "
                                                         "needs the `nkeys` package")
    credentials_file: str | None = Field(None, description="decentralized-auth .creds file (user JWT + NKey "
                                                           "seed); needs the `nkeys` package")
    tls: NatsTlsConfig = NatsTlsConfig()
    connect_timeout_s: float = Field(5.0, gt=0)
    request_timeout_s: float = Field(5.0, gt=0)
    max_reconnect_attempts: int = Field(-1, description="-1 = forever")
    reconnect_time_wait_s: float = Field(0.25, gt=0, description="pause between reconnect attempts to one server")
    reconnect_buffer_bytes: int = Field(8 * 1024 * 1024, ge=0, description=(
        "messages published while disconnected are kept up to this size and sent after the reconnect; "
        "0 = publish fails at once while disconnected"))
    reconnect_settle_s: float = Field(1.0, ge=0, description=(
        "after a reconnect, hold publishes this long so the other services are back and subscribed "
        "(a NATS message that finds no subscriber is dropped)"))
    replay_window_s: float = Field(1.0, ge=0, description=(
        "what was sent to the router in this window before a disconnect is sent again after the reconnect "
        "(the router drops duplicates; a dying server loses what it had not delivered); 0 = off"))

    @field_validator("url")
    @classmethod
    def _nats_scheme(cls, value: str) -> str:
        for url in value.split(","):
            if not url.strip().startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ValueError(f"{url!r} must start with nats:// (or tls://, ws://, wss://)")
        return value

    @field_validator("nkey_seed_file", "credentials_file")
    @classmethod
    def _exists(cls, value: str | None, info: Any) -> str | None:
        return _readable_file(f"nats.{info.field_name}", value)

    @model_validator(mode="after")
    def _one_identity(self) -> "NatsConfig":
        methods = [name for name, on in (("token", self.token), ("user/password", self.user or self.password),
                                         ("nkey_seed_file", self.nkey_seed_file),
                                         ("credentials_file", self.credentials_file)) if on]
        if len(methods) > 1:
            raise ValueError(f"nats: use one authentication method, not {' and '.join(methods)}")
        if self.password and not self.user:
            raise ValueError("nats.password is set without nats.user")
        return self

    @property
    def wants_tls(self) -> bool:
        return self.tls.enabled or any(u.strip().startswith(("tls://", "wss://")) for u in self.url.split(","))


class TransportConfig(_Strict):
    name: str = Field(..., description="plugin name: inproc, zmq, ucx or a third-party entry point")
    options: dict[str, Any] = Field(default_factory=dict)
    # the KV wire codec of this link (pdd.transports.codec; both ends must name the same one, or the import is
    # refused): lossless = byte shuffle + zstd, bit-exact, used only where it makes a frame cross sooner;
    # fp8 = e4m3 with a scale per block and head, lossy (changes tokens), only ever on by config
    codec: Literal["none", "lossless", "fp8", "fp8+lossless"] = Field(
        "none", description="KV wire codec: none, lossless, fp8 or fp8+lossless (fp8 first, then lossless)")

    @field_validator("options")
    @classmethod
    def _codec_not_an_option(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "codec" in value:
            raise ValueError("the KV codec is a field of the link, not an option: set transports.<link>.codec "
                             "(none, lossless, fp8 or fp8+lossless)")
        return value

    def plugin_options(self) -> dict[str, Any]:
        """The options ``create_transport`` takes for this link: ``options`` plus the codec."""
        return {**self.options, "codec": self.codec}


class TransportsConfig(_Strict):
    """One transport per KV link (shared/links.py `KVLink`: the field names are its values)."""

    fast: TransportConfig = TransportConfig(name="ucx")  # inside a site (P -> RLD, P -> MD in one site)
    wan: TransportConfig = TransportConfig(name="zmq", options={"streams": 4})  # across sites (P -> MD)

    def of(self, link: KVLink) -> TransportConfig:
        return getattr(self, link.value)


class SiteConfig(_Strict):
    name: str
    description: str = ""

    @field_validator("name")
    @classmethod
    def _safe(cls, value: str) -> str:
        return check_token(value)


class InstanceConfig(_Strict):
    id: str
    role: Role
    site: str
    metrics_port: int = Field(0, ge=0, le=65535, description="HTTP /metrics + /health; 0 = pick a free port")
    host: str = "127.0.0.1"

    @field_validator("id")
    @classmethod
    def _safe(cls, value: str) -> str:
        return check_token(value)


class RouterConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    reuse_port: bool = Field(False, description=(
        "bind the API port with SO_REUSEPORT so several router processes on this host share it (the kernel "
        "spreads connections over them; `pdd up --routers N` sets it). A port held by a process without it "
        "still refuses the bind"))
    request_timeout_s: float = Field(600.0, gt=0, description="per-request deadline")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    api_keys: list[str] = Field(default_factory=list, description="Bearer keys; empty = no auth")
    stall_timeout_s: float = Field(30.0, gt=0, description="a request whose decoder sends nothing for this long "
                                   "mid-stream is presumed stuck and migrates to another decode instance")
    max_migrations: int = Field(2, ge=0, description="failovers per request (resume elsewhere or retry on another "
                                "prefill); then the request fails with 503")
    wan_probe_interval_s: float = Field(2.0, gt=0, description="while a WAN link is down, probe it this often")
    instance_wait_s: float = Field(10.0, ge=0, description=(
        "a request that finds no live instance for a role it needs waits this long for one (inside its deadline), "
        "then gets 503 with Retry-After"))
    max_waiting_requests: int = Field(256, ge=0, description=(
        "requests waiting for an instance at once; one more gets 429 with Retry-After"))
    forced_pipeline: Pipeline | None = None
    forced_handoff: HandoffMode | None = None
    first_token_after_kv: bool = Field(
        False, description="conventional PD (the naive cross-site baseline): hold the first token until the "
                           "decoder that owns the request has its KV and streams; PDD streams it from P at once")

    @field_validator("forced_pipeline")
    @classmethod
    def _routable(cls, value: Pipeline | None) -> Pipeline | None:
        return routable(value)


class ServiceConfig(_Strict):
    heartbeat_ms: int = Field(500, ge=10, le=60_000)
    missed_heartbeats: int = Field(3, ge=1, description="after this many missed beats the registry suspects an "
                                   "instance: no new work, its requests kept")
    suspect_timeout_s: float = Field(5.0, ge=0, description=(
        "silence beyond missed_heartbeats before a suspected instance is declared lost and its requests migrate: "
        "an overloaded box delays beats by seconds, a dead process never beats again"))
    drain_timeout_s: float = Field(30.0, ge=0)


class TelemetryConfig(_Strict):
    exporter: Literal["auto", "otlp", "jsonl", "none"] = Field(
        "auto", description="auto: OTLP if OTEL_EXPORTER_OTLP_ENDPOINT is set, JSONL if jsonl_path is set, else none"
    )
    jsonl_path: str | None = None
    otlp_endpoint: str | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    log_prompts: bool = Field(False, description="log prompt text/token ids (off: prompts are user data)")


class PDDConfig(_Strict):
    """The deployment file. Beside these sections, an engine backend may own one (the emulated backend's
    ``emulation``): ``EnginePlugin.section``."""

    model_config = {"extra": "allow"}  # backends' own sections, checked by _engine_keys

    model: ModelConfig = ModelConfig()
    nats: NatsConfig = NatsConfig()
    sites: list[SiteConfig] = Field(default_factory=lambda: [SiteConfig(name="site-a"), SiteConfig(name="site-b")])
    instances: list[InstanceConfig] = Field(default_factory=list)
    transports: TransportsConfig = TransportsConfig()
    router: RouterConfig = RouterConfig()
    policy: PolicyConfig = PolicyConfig()
    service: ServiceConfig = ServiceConfig()
    telemetry: TelemetryConfig = TelemetryConfig()

    @model_validator(mode="after")
    def _engine_keys(self) -> "PDDConfig":
        """Refuse a key no backend knows (naming it), warn about a known key the chosen backend ignores (naming
        it), validate the chosen backend's settings."""
        plugin, ignored = engine_keys(self)
        for key in ignored:
            warnings.warn(f"{key}: means nothing to engine backend {plugin.name!r}; ignored", ConfigWarning,
                          stacklevel=2)
        problems = []
        for where, settings in (("model", self.engine_settings), (plugin.section, self.engine_section)):
            try:
                settings()
            except ValidationError as exc:
                problems += [f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e.get('input')!r})"
                             for e in exc.errors()]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def engine_settings(self) -> BaseModel:
        """The chosen backend's ``model.*`` settings, typed (``EnginePlugin.model_settings``)."""
        plugin = engine_plugin(self.model.backend)
        own = plugin.model_settings.model_fields
        return plugin.model_settings(**{k: v for k, v in (self.model.model_extra or {}).items() if k in own})

    def engine_section(self) -> BaseModel | None:
        """The chosen backend's own section (``EnginePlugin.section``), typed; None when it has none."""
        plugin = engine_plugin(self.model.backend)
        if plugin.section is None or plugin.section_settings is None:
            return None
        return plugin.section_settings.model_validate((self.model_extra or {}).get(plugin.section) or {})

    @model_validator(mode="after")
    def _consistent(self) -> "PDDConfig":
        site_names = [s.name for s in self.sites]
        if len(set(site_names)) != len(site_names):
            raise ValueError(f"sites: duplicate site names in {site_names}")
        ids = [i.id for i in self.instances]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"instances: duplicate id(s) {duplicates}; every instance needs its own id")
        for inst in self.instances:
            if inst.site not in site_names:
                raise ValueError(
                    f"instances[{inst.id}].site: unknown site {inst.site!r}; add it under 'sites' or use one of {site_names}"
                )
        return self

    def instance(self, instance_id: str) -> InstanceConfig:
        for inst in self.instances:
            if inst.id == instance_id:
                return inst
        raise ConfigError(f"instances: no instance with id {instance_id!r} (have {[i.id for i in self.instances]})")

    def first_of_role(self, role: str) -> InstanceConfig:
        for inst in self.instances:
            if inst.role == role:
                return inst
        raise ConfigError(f"instances: no instance with role {role!r}; add one or pass --instance-id")


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' env source over a given mapping (``load_config(environ=...)``), whose
    unparsable values name the variable."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)

    def prepare_field_value(self, field_name: str, field: Any, value: Any, value_is_complex: bool) -> Any:
        try:
            return super().prepare_field_value(field_name, field, value, value_is_complex)
        except ValueError as exc:  # JSON of a list or map that does not parse
            names = ", ".join(_env_names(self._environ, (field_name,)))
            raise ConfigError(f"{names}: not valid JSON ({exc}); lists and maps are given as JSON, "
                              f"e.g. PDD__ROUTER__API_KEYS='[\"k1\", \"k2\"]'") from None


_environ: ContextVar[Mapping[str, str]] = ContextVar("pdd_config_environ")


class _Settings(BaseSettings, PDDConfig):
    """PDDConfig read from the YAML file (init values) with ``PDD__SECTION__FIELD`` env overrides on top."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", env_parse_none_str="", extra="allow",
                                      validate_default=False)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   **_: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        return _EnvSource(settings_cls, _environ.get()), init_settings  # first wins: env over the file


def _env_names(environ: Mapping[str, str], loc: tuple) -> list[str]:
    """The PDD__ variables that set the field at ``loc``, a section around it, or a field inside it."""
    path = tuple(str(p).lower() for p in loc)
    names = []
    for key in environ:
        if key.upper().startswith(ENV_PREFIX):
            parts = tuple(key[len(ENV_PREFIX):].lower().split("__"))
            if parts[:len(path)] == path or path[:len(parts)] == parts:
                names.append(key)
    return sorted(names)


def _format_errors(source: str, exc: ValidationError, environ: Mapping[str, str]) -> str:
    lines = [f"{source}: invalid configuration ({exc.error_count()} problem(s)):"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        shown = err.get("input")
        last = str(err["loc"][-1]) if err["loc"] else ""
        if last in SECRET_KEYS and shown not in (None, ""):
            shown = REDACTED
        elif last == "url" and isinstance(shown, str):
            shown = redact_url(shown)
        else:
            shown = redact(shown)  # a section's dict (model-level errors) may hold secrets
        if err["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling (see docs/CONFIG in README) or remove it"
        elif err["type"] == "missing":
            msg = "required field is missing; add it"
        bare = err["type"] == "missing" or not err["loc"]  # a whole-file check names its key in the message
        line = f"  - {where}: {msg}" if bare else f"  - {where}: {msg} (got {shown!r})"
        names = _env_names(environ, err["loc"])
        lines.append(f"{line} [set by {', '.join(names)}]" if names else line)
    return "\n".join(lines)


def _apply_section_env(data: dict, environ: Mapping[str, str], sections: set[str]) -> None:
    """``PDD__SECTION__FIELD`` for an engine backend's own section: not a declared field, so pydantic-settings
    does not read it; set into the file's values here (env wins, as everywhere)."""
    for key, value in environ.items():
        if not key.upper().startswith(ENV_PREFIX):
            continue
        section, _, field = key[len(ENV_PREFIX):].lower().partition("__")
        if section in sections and field and isinstance(data.setdefault(section, {}), dict):
            data[section][field] = value


def load_config(path: str | os.PathLike | None, environ: dict[str, str] | None = None) -> PDDConfig:
    """Read the YAML file, let ``PDD__SECTION__FIELD`` variables override it (pydantic-settings), validate.

    Raises ConfigError with one line per bad field, naming the variable where one set it."""
    environ = dict(os.environ if environ is None else environ)
    data: dict = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read config file ({exc.strerror})") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: top level must be a mapping of sections (model, nats, instances, ...)")
    engine_sections = {p.section for p in engine_plugins().values() if p.section}
    sections = [*PDDConfig.model_fields, *sorted(engine_sections)]
    unknown = sorted(k for k in environ if k.upper().startswith(ENV_PREFIX)
                     and k[len(ENV_PREFIX):].split("__")[0].lower() not in sections)
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: no such config section (sections: {', '.join(sections)})")
    if any(not isinstance(key, str) for key in data):
        raise ConfigError(f"{source}: top-level keys must be section names (model, nats, instances, ...)")
    _apply_section_env(data, environ, engine_sections)
    token = _environ.set(environ)
    try:
        settings = _Settings(**data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(source, exc, environ)) from None
    except SettingsError as exc:  # wraps _EnvSource's ConfigError, which names the variable
        raise exc.__cause__ if isinstance(exc.__cause__, ConfigError) else ConfigError(str(exc)) from None
    finally:
        _environ.reset(token)
    return PDDConfig.model_construct(_fields_set=settings.model_fields_set, **(settings.model_extra or {}),
                                     **{name: getattr(settings, name) for name in PDDConfig.model_fields})


REDACTED = "<redacted>"
SECRET_KEYS = frozenset({"token", "password", "api_keys", "secret_key", "secret"})


_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^\s/@:,]*)(?P<pw>:[^\s/@,]*)?@")


def redact_url(text: str) -> str:
    """nats://user:pass@host -> nats://user:<redacted>@host, nats://tok@host -> nats://<redacted>@host,
    for every URL in the text (a comma-separated list, an error message)."""
    return _URL_CREDENTIALS.sub(
        lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@" if m["pw"] else f"{m['scheme']}{REDACTED}@", text)


def redact(data: Any) -> Any:
    """A copy of a config (or any nested dict/list) with secrets replaced: for printing and logging."""
    if isinstance(data, dict):
        out = {}
        for key, value in data.items():
            if key in SECRET_KEYS and value not in (None, "", [], {}):
                out[key] = [REDACTED] * len(value) if isinstance(value, list) else REDACTED
            elif key == "url" and isinstance(value, str):
                out[key] = redact_url(value)
            else:
                out[key] = redact(value)
        return out
    if isinstance(data, list):
        return [redact(v) for v in data]
    return data


def dump_config(config: PDDConfig, show_secrets: bool = False) -> str:
    """The effective config as YAML: every field, the chosen engine backend's keys with their defaults too."""
    data = config.model_dump(mode="json")
    data["model"].update(config.engine_settings().model_dump(mode="json"))
    section = config.engine_section()
    if section is not None:
        data[engine_plugin(config.model.backend).section] = section.model_dump(mode="json")
    return yaml.safe_dump(data if show_secrets else redact(data), sort_keys=False)
