#!/usr/bin/env bash
# The same-host path with a follower in another network namespace: ranks 0 and 1 in one
# namespace, rank 2 in another, joined by a veth pair (10.98.0.1/24 and 10.98.0.2/24) that Gloo
# uses (scripts/netns_common.sh). The abstract Unix socket of the root lives in its namespace,
# so the handshake must choose the network path for the whole group (batches bit-exact), and
# transport_mode::shared_memory must be refused on every rank with the reason.
#
# Bounded, self-cleaning (trap), and skipped - exit 77 - where it cannot run: not root, no
# ip(8), no network namespaces or veth pairs.
#
#   scripts/shm_netns_test.sh [path/to/spbcast_shm_worker]   (default: build/system/tests/)
set -uo pipefail
cd "$(dirname "$0")/.."

WORKER="${1:-build/system/tests/spbcast_shm_worker}"
NETNS_NAME=shm_netns_test
. scripts/netns_common.sh

[ -x "$WORKER" ] || fail "worker program $WORKER not found (build the spbcast_shm_worker target)"
netns_init
netns_pair sps 10.98.0.1 10.98.0.2
PORT=29400  # a fresh namespace: nothing else listens there; one port per run

run() {  # <transport> <expect>
    local status=0
    PORT=$((PORT + 1))
    PIDS=()
    for rank in 0 1 2; do
        local ns=$NS_A dev=$VETH_A
        if [ $rank = 2 ]; then ns=$NS_B; dev=$VETH_B; fi
        ip netns exec "$ns" env MASTER_ADDR=$ADDR_A MASTER_PORT=$PORT RANK=$rank WORLD_SIZE=3 LOCAL_RANK=$rank \
            GLOO_SOCKET_IFNAME=$dev timeout 120 \
            "$WORKER" check qwen3-vl-image 1 3 0 "$1" "$2" > "$WORK/rank$rank.log" 2>&1 &
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
