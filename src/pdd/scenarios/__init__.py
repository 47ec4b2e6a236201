"""Scenario files (package data: report.yaml, small.yaml) and the deployment they describe.

Neutral ground below the simulator and the live system: both read a scenario's chips, model, WAN link,
policy and systems through ``Deployment``; the simulator adds the workload (pdd.sim.scenario)."""

from pdd.scenarios.deployment import SCENARIO_DIR, Deployment, WanLink, build, load_yaml, set_path

__all__ = ["SCENARIO_DIR", "Deployment", "WanLink", "build", "load_yaml", "set_path"]
