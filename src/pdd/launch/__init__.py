"""Launchers: the `pdd` command, `pdd serve` (one role per process), `pdd up` and the programmable
local cluster, the nats-server launcher they use, and `pdd generate` (one engine, no services)."""
