#!/bin/sh
# The WAN between site-a and site-b: this container sits on both Docker networks, forwards between
# them (ip_forward via compose sysctls) and shapes each direction with tc netem on its egress
# interface, so one-way delay = WAN_DELAY and RTT = 2 x WAN_DELAY.
#   WAN_RATE (e.g. 1gbit) WAN_DELAY (20ms) WAN_JITTER (2ms) WAN_LOSS (0%) SITE_A_IP SITE_B_IP
set -eu
: "${WAN_RATE:=1gbit}" "${WAN_DELAY:=20ms}" "${WAN_JITTER:=0ms}" "${WAN_LOSS:=0%}"
: "${SITE_A_IP:=10.10.0.254}" "${SITE_B_IP:=10.20.0.254}"

dev_of() { ip -o -4 addr show | awk -v ip="$1" '{split($4, a, "/"); if (a[1] == ip) print $2}' | cut -d@ -f1; }

for ip in "$SITE_A_IP" "$SITE_B_IP"; do
    dev=$(dev_of "$ip")
    if [ -z "$dev" ]; then
        echo "wan: no interface holds $ip; check the compose networks' ipv4_address" >&2
        exit 1
    fi
    tc qdisc replace dev "$dev" root netem delay "$WAN_DELAY" "$WAN_JITTER" loss "$WAN_LOSS" rate "$WAN_RATE" limit 100000
    echo "wan: $dev ($ip) egress: rate $WAN_RATE delay $WAN_DELAY ±$WAN_JITTER loss $WAN_LOSS"
done
if [ "$(cat /proc/sys/net/ipv4/ip_forward)" != "1" ]; then
    echo "wan: ip_forward is off; set sysctls net.ipv4.ip_forward=1" >&2
    exit 1
fi
trap 'exit 0' TERM INT
while :; do sleep 3600 & wait $!; done
