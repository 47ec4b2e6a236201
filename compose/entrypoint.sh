#!/bin/sh
# Container entrypoint: route the other site's subnet through the WAN shaper, then run the command.
# WAN_ROUTE="10.20.0.0/24 via 10.10.0.254" (needs cap NET_ADMIN). Without it, the container stays
# in its own site: the only way across is the shaper, as between two real datacenters.
set -e
if [ -n "$WAN_ROUTE" ]; then
    # shellcheck disable=SC2086  # WAN_ROUTE is "SUBNET via GATEWAY", split on purpose
    if ! ip route replace $WAN_ROUTE; then
        echo "entrypoint: cannot add route '$WAN_ROUTE' (cap_add NET_ADMIN missing?)" >&2
        exit 1
    fi
fi
exec "$@"
