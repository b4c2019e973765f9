# Shared set-up of the network-namespace tests (netns_test.sh, shm_netns_test.sh), sourced by
# both: two "hosts" - two fresh network namespaces joined by a veth pair whose addresses exist
# only inside them - and the skip / fail / cleanup conventions. Ranks in a fresh namespace can
# use fixed ports: nothing else listens there.
#
# Before sourcing, set NETNS_NAME (the prefix of messages). Then:
#   skip <why> / fail <why>                exit 77 (ctest's SKIP_RETURN_CODE) / 1 with a message
#   netns_init                             $WORK, $PIDS, cleanup on exit (workers, namespaces);
#                                          skips without root or ip(8)
#   netns_pair <tag> <addr_a> <addr_b>     creates $NS_A, $NS_B and the veth ends $VETH_A (in
#                                          $NS_A, <addr_a>/24) and $VETH_B (in $NS_B, <addr_b>/24),
#                                          loopback and link up; exits 77 where the kernel or
#                                          sandbox has no namespaces or veth pairs
#   netns_bridge <tag> <hosts> <rate>      creates namespaces $BRIDGE_NS[i] at 10.96.0.<i+1>/24,
#                                          each joined to one bridge by a veth pair limited to
#                                          <rate> both ways (tc tbf), device $BRIDGE_DEV[i] inside;
#                                          exits 77 without bridges, veth pairs or tc
# shellcheck shell=bash

NETNS_SKIP=77

skip() { echo "$NETNS_NAME: SKIPPED: $*"; exit $NETNS_SKIP; }
fail() { echo "$NETNS_NAME: FAILED: $*"; exit 1; }

netns_init() {
    [ "$(id -u)" = 0 ] || skip "needs root to create network namespaces (run as root, or in CI as root)"
    command -v ip > /dev/null || skip "ip(8) from iproute2 is not installed"
    WORK="$(mktemp -d "/tmp/spbcast-$NETNS_NAME.XXXXXX")"
    PIDS=()
    NS_A=
    NS_B=
    VETH_A=
    BRIDGE=
    BRIDGE_NS=()
    BRIDGE_DEV=()
    trap netns_cleanup EXIT
    trap 'exit 1' INT TERM
}

netns_cleanup() {
    for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2> /dev/null; done
    [ -n "$NS_A" ] && ip netns del "$NS_A" 2> /dev/null
    [ -n "$NS_B" ] && ip netns del "$NS_B" 2> /dev/null
    [ -n "$VETH_A" ] && ip link del "$VETH_A" 2> /dev/null
    for ns in "${BRIDGE_NS[@]}"; do ip netns del "$ns" 2> /dev/null; done
    [ -n "$BRIDGE" ] && ip link del "$BRIDGE" 2> /dev/null
    rm -rf "$WORK"
}

netns_pair() {
    local tag=$1 id=$$
    ADDR_A=$2
    ADDR_B=$3
    NS_A="spbcast_${tag}a_$id"
    NS_B="spbcast_${tag}b_$id"
    VETH_A="${tag}A$id"
    VETH_B="${tag}B$id"
    ip netns add "$NS_A" 2> "$WORK/err" || skip "cannot create a network namespace: $(cat "$WORK/err")"
    ip netns add "$NS_B" 2> "$WORK/err" || skip "cannot create a network namespace: $(cat "$WORK/err")"
    ip link add "$VETH_A" type veth peer name "$VETH_B" 2> "$WORK/err" || skip "no veth pairs here: $(cat "$WORK/err")"
    ip link set "$VETH_A" netns "$NS_A" && ip link set "$VETH_B" netns "$NS_B" || fail "cannot move the veth ends"
    ip -n "$NS_A" addr add "$ADDR_A/24" dev "$VETH_A" && ip -n "$NS_B" addr add "$ADDR_B/24" dev "$VETH_B" ||
        fail "cannot give the veth ends their addresses"
    for ns in "$NS_A" "$NS_B"; do ip -n "$ns" link set lo up; done
    ip -n "$NS_A" link set "$VETH_A" up && ip -n "$NS_B" link set "$VETH_B" up || fail "cannot bring the link up"
}

netns_bridge() {
    local tag=$1 hosts=$2 rate=$3 id=$$ h ns inside outside
    command -v tc > /dev/null || skip "tc(8) from iproute2 is not installed"
    BRIDGE="${tag}br$id"
    ip link add "$BRIDGE" type bridge 2> "$WORK/err" || skip "no bridges here: $(cat "$WORK/err")"
    ip link set "$BRIDGE" up
    for h in $(seq 0 $((hosts - 1))); do
        ns="spbcast_${tag}${h}_$id" inside="${tag}h$h$id" outside="${tag}b$h$id"
        ip netns add "$ns" 2> "$WORK/err" || skip "cannot create a network namespace: $(cat "$WORK/err")"
        BRIDGE_NS+=("$ns")
        BRIDGE_DEV+=("$inside")
        ip link add "$inside" type veth peer name "$outside" 2> "$WORK/err" || skip "no veth pairs here: $(cat "$WORK/err")"
        ip link set "$inside" netns "$ns" && ip link set "$outside" master "$BRIDGE" up || fail "cannot join $ns to the bridge"
        ip -n "$ns" addr add "10.96.0.$((h + 1))/24" dev "$inside" || fail "cannot address $ns"
        ip -n "$ns" link set lo up && ip -n "$ns" link set "$inside" up || fail "cannot bring $ns's link up"
        tc -n "$ns" qdisc add dev "$inside" root tbf rate "$rate" burst 256kb latency 100ms 2> "$WORK/err" &&
            tc qdisc add dev "$outside" root tbf rate "$rate" burst 256kb latency 100ms 2>> "$WORK/err" ||
            skip "tc cannot limit the link: $(cat "$WORK/err")"
    done
}
