#!/usr/bin/env bash
# The same-host path with ranks in another network namespace, which spbcast takes for another
# host: namespaces joined by a veth pair (10.98.0.1/24 and 10.98.0.2/24) that Gloo uses
# (scripts/netns_common.sh). With ranks 0 and 1 in one namespace and rank 2 in the other,
# automatic must choose the hierarchical path (one copy over the link, shared memory on the root's
# side, batches bit-exact) and transport_mode::shared_memory must be refused on every rank with the
# reason; with one rank on each side automatic must choose the network path (hierarchical relays
# there too); with two ranks on each side, over 3 + 1 and over three bridged hosts of 2 + 2 + 1 or
# of one rank each, the hierarchical path.
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

# Waits for the $1 ranks in $PIDS and shows each one's log; fails if one failed ($2: the case).
wait_ranks() {
    local status=0 rank
    for rank in $(seq 0 $(($1 - 1))); do
        wait "${PIDS[$rank]}" || { status=1; echo "shm_netns_test: rank $rank failed $2:"; }
        sed "s/^/  rank $rank: /" "$WORK/rank$rank.log"
    done
    return $status
}

run() {  # <world> <first rank in the second namespace> <root> <transport> <expect>
    local world=$1 split=$2 root=$3
    PORT=$((PORT + 1))
    PIDS=()
    for rank in $(seq 0 $((world - 1))); do
        local ns=$NS_A dev=$VETH_A
        if [ "$rank" -ge "$split" ]; then ns=$NS_B; dev=$VETH_B; fi
        ip netns exec "$ns" env MASTER_ADDR=$ADDR_A MASTER_PORT=$PORT RANK=$rank WORLD_SIZE=$world LOCAL_RANK=$rank \
            GLOO_SOCKET_IFNAME=$dev SPBCAST_TEST_NO_DESCRIPTORS_RANK="${NO_DESCRIPTORS_RANK:--1}" timeout 120 \
            "$WORKER" check qwen3-vl-image 1 3 "$root" "$4" "$5" > "$WORK/rank$rank.log" 2>&1 &
        PIDS+=($!)
    done
    wait_ranks "$world" "($world ranks, root $root, $4, expecting $5)"
}

# automatic relays to a rank alone on its side too (the root's side still shares its pages), but
# not for one rank on each side, where the relay and the network path send the same one copy.
run 3 2 0 auto hosts || fail "transport automatic with a follower alone in another network namespace"
run 2 1 0 auto network || fail "transport automatic with one rank on each side"
run 2 1 0 hier hosts || fail "transport hierarchical with one rank on each side"
run 4 3 0 auto hosts || fail "transport automatic over 3 + 1 ranks"
run 3 2 0 shm refused || fail "transport shared_memory with a follower in another network namespace"
grep -q "another network namespace" "$WORK/rank0.log" || fail "the refusal does not name the reason"
# Two ranks on each side: the payload crosses the link once, to the other side's host leader.
run 4 2 0 auto hosts || fail "transport automatic over two namespaces of two ranks each"
grep -q "rank 2 leader 2 serves 1" "$WORK/rank2.log" && grep -q "rank 3 leader 2 serves 0" "$WORK/rank3.log" ||
    fail "rank 2 does not lead the other side"
run 4 2 3 auto hosts || fail "transport automatic over two namespaces, the root not its side's lowest rank"
# A rank alone on its side: hierarchical relays to it all the same (into its own memory).
run 3 2 1 hier hosts || fail "transport hierarchical with a follower alone in another network namespace"
# The other side's would-be leader can open no descriptor in the handshake (it cannot even read
# its host's identity): it and the other rank there each get the payload on their own.
NO_DESCRIPTORS_RANK=2 run 4 2 0 hier hosts || fail "a side whose leader cannot create segments"
grep -q "rank 2 leader 2 serves 0" "$WORK/rank2.log" && grep -q "rank 3 leader 3 serves 0" "$WORK/rank3.log" ||
    fail "the other side's ranks are not served on their own when its leader cannot"
# Faults on the hierarchical path, 2 ranks on each side: the root, the other side's host leader
# or a follower behind it is SIGKILLed, or the link is cut, while batches flow; every survivor
# must raise a spbcast error (exit 3: no descriptor of ours left open) well within the bound.
faults() {  # <victim rank or "link"> <what>
    local status=0 start victim=$1
    [ "$1" = link ] && victim=-1  # nobody is killed
    PORT=$((PORT + 1))
    PIDS=()
    start=$(date +%s)
    for rank in 0 1 2 3; do
        local ns=$NS_A dev=$VETH_A
        if [ $rank -ge 2 ]; then ns=$NS_B; dev=$VETH_B; fi
        ip netns exec "$ns" env MASTER_ADDR=$ADDR_A MASTER_PORT=$PORT RANK=$rank WORLD_SIZE=4 LOCAL_RANK=$rank \
            GLOO_SOCKET_IFNAME=$dev SPBCAST_TEST_KILL_RANK="$victim" SPBCAST_TEST_KILL_AFTER_MS=2500 timeout 60 \
            "$WORKER" kill_loop 7 > "$WORK/rank$rank.log" 2>&1 &
        PIDS+=($!)
    done
    if [ "$1" = link ]; then  # once every rank broadcasts
        for _ in $(seq 300); do
            [ "$(cat "$WORK"/rank[0-3].log 2> /dev/null | grep -c running)" = 4 ] && break
            sleep 0.1
        done
        sleep 0.5
        ip -n "$NS_B" link set "$VETH_B" down
    fi
    for rank in 0 1 2 3; do
        local code=0
        wait "${PIDS[$rank]}" || code=$?
        if [ "$rank" = "$1" ]; then
            [ $code = 137 ] || { status=1; echo "shm_netns_test: the victim, rank $rank, ended with $code"; }
        elif [ $code != 3 ]; then
            status=1
            echo "shm_netns_test: rank $rank did not raise a clean spbcast error ($2, exit $code):"
        fi
        sed "s/^/  rank $rank: /" "$WORK/rank$rank.log"
    done
    [ "$1" = link ] && ip -n "$NS_B" link set "$VETH_B" up
    local took=$(($(date +%s) - start))
    echo "shm_netns_test: $2: every survivor raised within ${took} s"
    [ $took -le 40 ] || { status=1; echo "shm_netns_test: $2 took ${took} s"; }
    return $status
}
faults 0 "the root killed" || fail "the root killed on the hierarchical path"
faults 2 "the other side's host leader killed" || fail "a host leader killed on the hierarchical path"
faults 3 "a follower behind the host leader killed" || fail "a follower behind a host leader killed"
faults link "the link cut" || fail "the link cut on the hierarchical path"
# Three hosts of two ranks on 200 Mbit/s links with options.timeout = 1 s: 96 MiB takes about
# 4 s to relay, broadcast twice in a row, yet arrives, since every wait covers one 4 MiB chunk or
# report (the root's host included); and a 2 MiB view of a 48 MiB shared storage sends only its
# 2 MiB over each link.
netns_bridge spl 3 200mbit
PORT=$((PORT + 1))
PIDS=()
start=$(date +%s)
for rank in 0 1 2 3 4 5; do
    h=$((rank / 2))
    ip netns exec "${BRIDGE_NS[$h]}" env MASTER_ADDR=10.96.0.1 MASTER_PORT=$PORT RANK=$rank WORLD_SIZE=6 \
        LOCAL_RANK=$((rank % 2)) GLOO_SOCKET_IFNAME="${BRIDGE_DEV[$h]}" HOST_COUNTER=$((1 - rank % 2)) timeout 60 \
        "$WORKER" slow_links $((4 << 20)) > "$WORK/rank$rank.log" 2>&1 &
    PIDS+=($!)
done
status=0
wait_ranks 6 "on slow links" || status=1
echo "shm_netns_test: 3 hosts x 2 ranks on 200 Mbit/s links: $(($(date +%s) - start)) s"
[ $status = 0 ] || fail "96 MiB twice over 3 hosts on slow links with a 1 s timeout, or a view's bytes over the links"
# Uneven hosts on the same bridge, under automatic, which relays over all three: 2 + 2 + 1 ranks
# with the root alone on its host and then on a host of two, and one rank on each host.
bridge_check() {  # <root> <host of rank 0> <host of rank 1> ...
    local root=$1 world=$(($# - 1))
    shift
    PORT=$((PORT + 1))
    PIDS=()
    local rank=0
    for h in "$@"; do
        ip netns exec "${BRIDGE_NS[$h]}" env MASTER_ADDR=10.96.0.$(($1 + 1)) MASTER_PORT=$PORT RANK=$rank \
            WORLD_SIZE=$world LOCAL_RANK=$rank GLOO_SOCKET_IFNAME="${BRIDGE_DEV[$h]}" timeout 120 \
            "$WORKER" check text 1 2 "$root" auto hosts > "$WORK/rank$rank.log" 2>&1 &
        PIDS+=($!)
        rank=$((rank + 1))
    done
    wait_ranks "$world" "(hosts $*, root $root)"
}
bridge_check 4 0 0 1 1 2 || fail "transport automatic over 2 + 2 + 1 ranks, the root alone on its host"
bridge_check 2 0 0 1 1 2 || fail "transport automatic over 2 + 2 + 1 ranks, the root on the second host"
bridge_check 1 0 1 2 || fail "transport automatic over three hosts of one rank each"
echo "shm_netns_test: PASSED"
