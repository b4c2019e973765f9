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
    trap netns_cleanup EXIT
    trap 'exit 1' INT TERM
}

netns_cleanup() {
    for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2> /dev/null; done
    [ -n "$NS_A" ] && ip netns del "$NS_A" 2> /dev/null
    [ -n "$NS_B" ] && ip netns del "$NS_B" 2> /dev/null
    [ -n "$VETH_A" ] && ip link del "$VETH_A" 2> /dev/null
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
