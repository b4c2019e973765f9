#!/usr/bin/env bash
# The same-host path with a follower in another network namespace: ranks 0 and 1 in this
# namespace, rank 2 in a new one, joined by a veth pair (10.98.0.1/24 here, 10.98.0.2/24
# there) that Gloo uses. The abstract Unix socket of the root lives in this namespace, so the
# handshake must choose the network path for the whole group (batches bit-exact), and
# transport_mode::shared_memory must be refused on every rank with the reason.
#
# Bounded, self-cleaning (trap), and skipped - exit 77 - where it cannot run: not root, no
# ip(8), no network namespaces or veth pairs.
#
#   scripts/shm_netns_test.sh [path/to/spbcast_shm_worker]   (default: build/system/tests/)
set -uo pipefail
cd "$(dirname "$0")/.."

WORKER="${1:-build/system/tests/spbcast_shm_worker}"
SKIP=77
skip() { echo "shm_netns_test: SKIPPED: $*"; exit $SKIP; }
fail() { echo "shm_netns_test: FAILED: $*"; exit 1; }

[ -x "$WORKER" ] || fail "worker program $WORKER not found (build the spbcast_shm_worker target)"
[ "$(id -u)" = 0 ] || skip "needs root to create a network namespace"
command -v ip > /dev/null || skip "ip(8) from iproute2 is not installed"

id=$$
NS="spbcast_shm_$id"
VETH_A="spsA$id"
VETH_B="spsB$id"
ADDR_A=10.98.0.1
ADDR_B=10.98.0.2
WORK="$(mktemp -d /tmp/spbcast-shm-netns.XXXXXX)"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2> /dev/null; done
    ip link del "$VETH_A" 2> /dev/null
    ip netns del "$NS" 2> /dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

ip netns add "$NS" 2> "$WORK/err" || skip "cannot create a network namespace: $(cat "$WORK/err")"
ip link add "$VETH_A" type veth peer name "$VETH_B" netns "$NS" 2> "$WORK/err" || skip "no veth pairs here: $(cat "$WORK/err")"
ip addr add "$ADDR_A/24" dev "$VETH_A" && ip link set "$VETH_A" up || fail "cannot configure $VETH_A"
ip -n "$NS" addr add "$ADDR_B/24" dev "$VETH_B" && ip -n "$NS" link set "$VETH_B" up && ip -n "$NS" link set lo up ||
    fail "cannot configure $VETH_B"

run() {  # <transport> <expect>
    local port=$((30000 + RANDOM % 20000)) status=0
    PIDS=()
    for rank in 0 1 2; do
        local env=(MASTER_ADDR=$ADDR_A MASTER_PORT=$port RANK=$rank WORLD_SIZE=3 LOCAL_RANK=$rank)
        if [ $rank = 2 ]; then
            ip netns exec "$NS" env "${env[@]}" GLOO_SOCKET_IFNAME=$VETH_B timeout 120 \
                "$WORKER" check qwen3-vl-image 1 3 0 "$1" "$2" > "$WORK/rank$rank.log" 2>&1 &
        else
            env "${env[@]}" GLOO_SOCKET_IFNAME=$VETH_A timeout 120 \
                "$WORKER" check qwen3-vl-image 1 3 0 "$1" "$2" > "$WORK/rank$rank.log" 2>&1 &
        fi
        PIDS+=($!)
    done
    for rank in 0 1 2; do
        wait "${PIDS[$rank]}" || { status=1; echo "shm_netns_test: rank $rank failed ($1, expecting $2):"; }
        sed "s/^/  rank $rank: /" "$WORK/rank$rank.log"
    done
    return $status
}

run auto network || fail "transport automatic with a follower in another network namespace"
run shm refused || fail "transport shared_memory with a follower in another network namespace"
grep -q "another network namespace" "$WORK/rank0.log" || fail "the refusal does not name the reason"
echo "shm_netns_test: PASSED"
