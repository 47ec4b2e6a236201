#!/bin/sh
# The WAN between site-a and site-b. This container sits on both Docker networks and is the only way
# across: every site container routes the other subnet through it (entrypoint.sh, WAN_ROUTE).
#
#   shape.sh run     apply the shaping from WAN_* and forward until stopped (the container's command)
#   shape.sh check   exit 0 only if the shaping is really in place (the healthcheck); prints it
#   shape.sh set rate=50mbit [delay=40ms] [jitter=..] [loss=..]   reshape at run time:
#                    docker compose -f compose/docker-compose.yaml exec wan sh compose/wan/shape.sh set rate=50mbit
#
# Two ways to shape, the same on the wire (one-way delay = WAN_DELAY, RTT = 2 x WAN_DELAY):
#   netem  where the kernel has it: one `tc netem` (rate, delay, jitter, loss) on each egress interface;
#   relay  where it has not: each direction is routed (policy rule on the incoming interface) into a TUN
#          device; tc tbf on the TUN sets the rate; the project's user-space relay
#          (`python -m pdd.transports.wan_emulation relay`, what `pdd wan` runs) owns both TUNs and
#          releases every packet to the other one after delay ± jitter, dropping a loss fraction.
#          In relay mode a paused container (`docker compose pause wan`) forwards nothing: a cut link.
# WAN_MODE=auto|netem|relay (auto: netem if the kernel accepts it). Needs NET_ADMIN, /dev/net/tun (relay),
# sysctls net.ipv4.ip_forward=1 and rp_filter=0 (the relay's packets re-enter on the TUN).
set -eu
cd /   # `python -m pdd...` must find the installed package, not a folder in the working directory
: "${WAN_RATE:=1gbit}" "${WAN_DELAY:=20ms}" "${WAN_JITTER:=0ms}" "${WAN_LOSS:=0%}" "${WAN_MODE:=auto}"
: "${SITE_A_IP:=10.10.0.254}" "${SITE_B_IP:=10.20.0.254}"
STATE=/run/pdd-wan
TUN_A=wan-a          # packets from site A enter here; the relay writes them to TUN_B, towards site B
TUN_B=wan-b
TUN_MTU=65000        # as the site networks: few, large packets keep the relay's CPU low

dev_of() { ip -o -4 addr show | awk -v ip="$1" '{split($4, a, "/"); if (a[1] == ip) print $2}' | cut -d@ -f1; }
log() { echo "wan: $*"; }

load_state() {  # the current shape: WAN_* from the environment, overridden by the last `set`
    if [ -f "$STATE/shape.env" ]; then . "$STATE/shape.env"; fi
    DEV_A=$(dev_of "$SITE_A_IP"); DEV_B=$(dev_of "$SITE_B_IP")
    if [ -z "$DEV_A" ] || [ -z "$DEV_B" ]; then
        echo "wan: no interface holds $SITE_A_IP / $SITE_B_IP; check the compose networks' ipv4_address" >&2
        exit 1
    fi
}

save_state() {
    mkdir -p "$STATE"
    printf 'WAN_RATE=%s\nWAN_DELAY=%s\nWAN_JITTER=%s\nWAN_LOSS=%s\nWAN_MODE=%s\n' \
        "$WAN_RATE" "$WAN_DELAY" "$WAN_JITTER" "$WAN_LOSS" "$WAN_MODE" > "$STATE/shape.env"
}

# The project's tc-style unit parser (pdd.transports.units; the package loads nothing heavy before it is used)
#   units EXPR ARGS...   EXPR sees rate_bits, seconds, fraction and argv (the ARGS); prints its value
units() {
    python - "$@" <<'EOF'
import sys

from pdd.transports.units import fraction, rate_bits, seconds

value = eval(sys.argv[1], {"argv": sys.argv[2:], "rate_bits": rate_bits, "seconds": seconds, "fraction": fraction})
print(*value) if isinstance(value, tuple) else print(value)
EOF
}

# tbf wants a burst of at least one packet and a queue: the numbers `pdd wan` uses
tbf_args() {
    units '(lambda r, b: ("rate", f"{int(r)}bit", "burst", b, "limit", max(2 * b, int(r / 8 * 0.1))))(
        rate_bits(argv[0]), max(2 * int(argv[1]) + 1600, int(rate_bits(argv[0]) / 8 / 250)))' "$WAN_RATE" "$TUN_MTU"
}

apply_netem() {
    for dev in "$DEV_A" "$DEV_B"; do
        tc qdisc replace dev "$dev" root netem delay "$WAN_DELAY" "$WAN_JITTER" loss "$WAN_LOSS" rate "$WAN_RATE" \
            limit 100000
    done
}

start_relay() {  # (re)start the relay with the current delay, jitter and loss; it creates both TUNs
    if [ -f "$STATE/relay.pid" ]; then
        kill "$(cat "$STATE/relay.pid")" 2>/dev/null || true
        while ip link show "$TUN_A" >/dev/null 2>&1; do sleep 0.05; done
    fi
    # shellcheck disable=SC2046  # three numbers, split on purpose
    set -- $(units '(seconds(argv[0]), seconds(argv[1]), fraction(argv[2]))' "$WAN_DELAY" "$WAN_JITTER" "$WAN_LOSS")
    rm -f "$STATE/relay.out"
    python -m pdd.transports.wan_emulation relay "$TUN_A" "$TUN_B" "$1" "$2" "$3" > "$STATE/relay.out" 2>&1 &
    echo $! > "$STATE/relay.pid"
    until grep -q READY "$STATE/relay.out" 2>/dev/null; do
        kill -0 "$(cat "$STATE/relay.pid")" 2>/dev/null || { cat "$STATE/relay.out" >&2; exit 1; }
        sleep 0.05
    done
    for tun in "$TUN_A" "$TUN_B"; do
        ip link set "$tun" mtu "$TUN_MTU" txqueuelen 1000 up
    done
    # what arrives from a site goes into its TUN (the relay reads it there); nothing bypasses the relay:
    # without the TUN route (relay restarting) the packet hits the blackhole rule, not the main table
    ip route replace default dev "$TUN_A" table 100
    ip route replace default dev "$TUN_B" table 101
}

apply_tbf() {
    for tun in "$TUN_A" "$TUN_B"; do
        # shellcheck disable=SC2046  # tbf_args is "rate R burst B limit L", split on purpose
        tc qdisc replace dev "$tun" root tbf $(tbf_args)
    done
}

rules() {
    ip rule show | grep -q "lookup 100" || ip rule add iif "$DEV_A" lookup 100 priority 100
    ip rule show | grep -q "iif $DEV_A blackhole" || ip rule add iif "$DEV_A" blackhole priority 101
    ip rule show | grep -q "lookup 101" || ip rule add iif "$DEV_B" lookup 101 priority 102
    ip rule show | grep -q "iif $DEV_B blackhole" || ip rule add iif "$DEV_B" blackhole priority 103
}

describe() { log "mode $WAN_MODE: rate $WAN_RATE delay $WAN_DELAY ±$WAN_JITTER loss $WAN_LOSS ($DEV_A <-> $DEV_B)"; }

cmd_run() {
    rm -rf "$STATE"   # a restarted container starts from WAN_*: a `set` lasts until then
    load_state
    if [ "$(cat /proc/sys/net/ipv4/ip_forward)" != "1" ]; then
        echo "wan: ip_forward is off; set sysctls net.ipv4.ip_forward=1" >&2
        exit 1
    fi
    if [ "$WAN_MODE" = auto ]; then
        if tc qdisc replace dev "$DEV_A" root netem delay 0ms 2>/dev/null; then WAN_MODE=netem; else WAN_MODE=relay; fi
        if [ "$WAN_MODE" = relay ]; then log "the kernel has no netem: tbf for the rate, the user-space relay for delay"; fi
    fi
    save_state
    if [ "$WAN_MODE" = netem ]; then
        apply_netem
    else
        start_relay
        apply_tbf
        rules
    fi
    describe
    trap 'exit 0' TERM INT
    while :; do
        if [ "$WAN_MODE" = relay ] && ! kill -0 "$(cat "$STATE/relay.pid")" 2>/dev/null; then
            echo "wan: the relay exited:" >&2; cat "$STATE/relay.out" >&2; exit 1
        fi
        sleep 5 & wait $!
    done
}

cmd_set() {
    load_state
    old_delay="$WAN_DELAY $WAN_JITTER $WAN_LOSS"
    for kv in "$@"; do
        case "$kv" in
            rate=*) WAN_RATE=${kv#rate=} ;;
            delay=*) WAN_DELAY=${kv#delay=} ;;
            jitter=*) WAN_JITTER=${kv#jitter=} ;;
            loss=*) WAN_LOSS=${kv#loss=} ;;
            *) echo "wan: unknown setting '$kv'; use rate= delay= jitter= loss=" >&2; exit 2 ;;
        esac
    done
    # a typo fails here, before anything changes
    units '(rate_bits(argv[0]), seconds(argv[1]), seconds(argv[2]), fraction(argv[3]))' \
        "$WAN_RATE" "$WAN_DELAY" "$WAN_JITTER" "$WAN_LOSS" >/dev/null
    if [ "$WAN_MODE" = netem ]; then
        apply_netem
    else
        if [ "$old_delay" != "$WAN_DELAY $WAN_JITTER $WAN_LOSS" ]; then start_relay; fi
        apply_tbf
    fi
    save_state
    describe
}

cmd_check() {
    load_state
    if [ "$WAN_MODE" = netem ]; then
        for dev in "$DEV_A" "$DEV_B"; do
            tc qdisc show dev "$dev" | grep -q netem || { echo "wan: no netem on $dev" >&2; exit 1; }
        done
    else
        kill -0 "$(cat "$STATE/relay.pid" 2>/dev/null || echo 0)" 2>/dev/null || { echo "wan: relay not running" >&2; exit 1; }
        for tun in "$TUN_A" "$TUN_B"; do
            tc qdisc show dev "$tun" 2>/dev/null | grep -q "tbf" || { echo "wan: no tbf on $tun" >&2; exit 1; }
        done
        ip route show table 100 | grep -q "dev $TUN_A" || { echo "wan: site A is not routed into the relay" >&2; exit 1; }
        ip route show table 101 | grep -q "dev $TUN_B" || { echo "wan: site B is not routed into the relay" >&2; exit 1; }
        ip rule show | grep -q "iif $DEV_A lookup 100" || { echo "wan: no rule for $DEV_A" >&2; exit 1; }
        ip rule show | grep -q "iif $DEV_B lookup 101" || { echo "wan: no rule for $DEV_B" >&2; exit 1; }
    fi
    describe
}

case "${1:-run}" in
    run) cmd_run ;;
    set) shift; cmd_set "$@" ;;
    check) cmd_check ;;
    *) echo "usage: shape.sh run | check | set rate=R delay=D jitter=J loss=L" >&2; exit 2 ;;
esac
