#!/usr/bin/env bash
# Real network faults: spbcast ranks on two "hosts" - two network namespaces joined by a veth
# pair, 10.99.0.1/24 and 10.99.0.2/24, which exist only inside those namespaces - with Gloo over
# that link (GLOO_SOCKET_IFNAME), 4 ranks, 2 per host.
#
#   1. impaired link: delay and packet loss on both ends (tc netem where the kernel has it;
#      otherwise a tbf rate limit, whose queue adds delay, and nftables random drop for loss);
#      30 realistic batches from a root on host A, then 30 from a root on host B, each checked
#      bit-exact on every rank (the worker compares spbcast::digest with the batch it rebuilds
#      itself).
#   2. dead root: rank 0 is killed, a forked child of it living on; every survivor names it
#      within 1 s, those of host B from the group's store (the link unimpaired from here on).
#   3. cut link: ranks broadcast a batch every 100 ms; after a few steps the link goes down
#      (ip link set down); every rank must raise a spbcast error - none may hang - within
#      a bound derived from options.timeout; each rank's time from the cut is printed.
#
# Bounded (timeouts on every wait and process), self-cleaning (trap: namespaces, veth, workers),
# and skipped - exit 77, ctest's SKIP_RETURN_CODE - with a message where it cannot run: not
# root, no ip(8), no network namespaces or veth in this kernel/sandbox.
#
#   scripts/netns_test.sh [path/to/spbcast_fault_worker]   (default: build/system/tests/faults/)
set -uo pipefail
cd "$(dirname "$0")/.."

WORKER="${1:-build/system/tests/faults/spbcast_fault_worker}"
TIMEOUT_MS="${SPBCAST_NETNS_TIMEOUT_MS:-3000}"
NETNS_NAME=netns_test
. scripts/netns_common.sh

[ -x "$WORKER" ] || fail "worker program $WORKER not found (build the spbcast_fault_worker target)"
netns_init
command -v tc > /dev/null || skip "tc(8) from iproute2 is not installed"
netns_pair spb 10.99.0.1 10.99.0.2
echo "netns_test: host A = $NS_A ($ADDR_A on $VETH_A), host B = $NS_B ($ADDR_B on $VETH_B)"

# ---- impairment ------------------------------------------------------------------------------
impair() {  # <ns> <dev>
    local ns=$1 dev=$2
    if ip netns exec "$ns" tc qdisc add dev "$dev" root netem delay 20ms 5ms loss 1% 2> "$WORK/err"; then
        echo "netns_test: $dev: netem delay 20ms +-5ms, loss 1%"
        return 0
    fi
    echo "netns_test: $dev: tc netem is not available ($(tr -d '\n' < "$WORK/err")); using tbf + nftables"
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate 100mbit burst 32kb latency 20ms \
        || fail "neither netem nor tbf can shape $dev"
    echo "netns_test: $dev: tbf 100 mbit/s with a 20 ms queue (queueing delay under load)"
    if command -v nft > /dev/null; then
        ip netns exec "$ns" nft add table inet spbcast_loss &&
        ip netns exec "$ns" nft add chain inet spbcast_loss out '{ type filter hook output priority 0; }' &&
        ip netns exec "$ns" nft add rule inet spbcast_loss out oifname "$dev" meta l4proto tcp \
            numgen random mod 100 '<' 1 counter drop ||
            fail "cannot add the nftables loss rule"
        echo "netns_test: $dev: nftables drops 1% of outgoing TCP packets"
    else
        echo "netns_test: $dev: nft(8) is not installed (Debian package nftables): no packet loss, delay only"
    fi
}

unimpair() {  # <ns> <dev>: what impair added, gone
    ip netns exec "$1" tc qdisc del dev "$2" root 2> /dev/null
    ip netns exec "$1" nft delete table inet spbcast_loss 2> /dev/null
}

# Starts 4 ranks (0, 1 on host A; 2, 3 on host B) with the given worker arguments.
start_ranks() {
    local port=$1; shift
    PIDS=()
    for rank in 0 1 2 3; do
        local ns=$NS_A dev=$VETH_A
        if [ "$rank" -ge 2 ]; then ns=$NS_B; dev=$VETH_B; fi
        ip netns exec "$ns" env MASTER_ADDR=$ADDR_A MASTER_PORT="$port" RANK=$rank WORLD_SIZE=4 \
            LOCAL_RANK=$((rank % 2)) GLOO_SOCKET_IFNAME="$dev" \
            timeout -s KILL 180 "$WORKER" "$@" > "$WORK/rank$rank.log" 2>&1 &
        PIDS+=($!)
    done
}

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
secs() { printf '%d.%03d' $(( $1 / 1000 )) $(( $1 % 1000 )); }

# Waits for every rank (start in ms, deadline in s); writes "rank exit_code ms" lines to
# $WORK/exits, ms counted from start.
wait_ranks() {
    local start=$1 deadline=$2
    : > "$WORK/exits"
    local left=4
    local -A done=()
    while [ $left -gt 0 ]; do
        for rank in 0 1 2 3; do
            [ -n "${done[$rank]:-}" ] && continue
            if ! kill -0 "${PIDS[$rank]}" 2> /dev/null; then
                wait "${PIDS[$rank]}"
                local code=$?
                echo "$rank $code $(( $(now_ms) - start ))" >> "$WORK/exits"
                done[$rank]=1
                left=$((left - 1))
            fi
        done
        if [ $(( $(now_ms) - start )) -gt $(( deadline * 1000 )) ]; then
            for rank in 0 1 2 3; do [ -z "${done[$rank]:-}" ] && echo "$rank hung $(( deadline * 1000 ))" >> "$WORK/exits"; done
            for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2> /dev/null; done
            return 1
        fi
        sleep 0.05
    done
    return 0
}

show_logs() {
    for rank in 0 1 2 3; do
        echo "--- rank $rank"
        grep -v " ok digest " "$WORK/rank$rank.log" | tail -n 8
    done
}

impair "$NS_A" "$VETH_A"
impair "$NS_B" "$VETH_B"

status=0
for root in 0 3; do
    echo "netns_test: impaired link, 30 steps from root $root (on host $([ $root -lt 2 ] && echo A || echo B))"
    start=$(now_ms)
    start_ranks $((29400 + root)) steps=30 root=$root profile=text micro=1 timeout_ms=30000 \
        group_timeout_ms=60000 checksum=1
    wait_ranks "$start" 150 || { show_logs; fail "a rank hung on the impaired link"; }
    while read -r rank code ms; do
        steps_ok=$(grep -c " ok digest " "$WORK/rank$rank.log")
        echo "netns_test:   rank $rank: exit $code, $steps_ok/30 steps bit-exact, $(secs "$ms") s"
        if [ "$code" != 0 ] || [ "$steps_ok" != 30 ]; then status=1; fi
    done < <(sort -n "$WORK/exits")
    [ $status = 0 ] || { show_logs; fail "batches did not all arrive bit-exact over the impaired link"; }
done
for ns in "$NS_A" "$NS_B"; do
    ip netns exec "$ns" nft list table inet spbcast_loss 2> /dev/null | grep -o 'counter packets [0-9]*' \
        | sed "s/^/netns_test: $ns dropped /"
done

# ---- a dead rank named on the other host ------------------------------------------------------
# The broadcasts on the c10d group itself (automatic: the hierarchical path, rank 2 leading host
# B), the store served by a process of its own (torchrun's agent), each rank with a forked child
# that outlives it. Rank 0 kills itself before step 3: rank 1, on its host, names it from the
# kernel's notice; ranks 2 and 3 from the group's store, where rank 1 wrote it (death_board.hpp);
# each within 1 s of the kill (CLOCK_MONOTONIC, one clock for every namespace). Without the
# impairment, which would time the lossy link instead.
unimpair "$NS_A" "$VETH_A"
unimpair "$NS_B" "$VETH_B"
echo "netns_test: dead root: killed before step 3, its forked child living on; the link unimpaired"
ip netns exec "$NS_A" env MASTER_ADDR=$ADDR_A timeout -s KILL 100 "$WORKER" serve_store=29450 serve_ms=90000 \
    > "$WORK/store.log" 2>&1 &
store_pid=$!
sleep 0.5
start=$(now_ms)
TORCHELASTIC_USE_AGENT_STORE=True start_ranks 29450 steps=6 root=0 profile=text micro=1 timeout_ms=20000 \
    group_timeout_ms=60000 group=c10d fork_child=1 exit=clean fault=kill fault_rank=0 fault_step=3
wait_ranks "$start" 90 || { show_logs; fail "a rank hung after the root was killed"; }
kill "$store_pid" 2> /dev/null
wait "$store_pid" 2> /dev/null
killed=$(grep -o "FAULT kill before message [0-9]* at [0-9]*" "$WORK/rank0.log" | grep -o "[0-9]*$")
[ -n "$killed" ] || { show_logs; fail "rank 0 did not kill itself"; }
while read -r rank code ms; do
    [ "$rank" = 0 ] && { [ "$code" = 137 ] || { status=1; echo "netns_test:   rank 0 ended with $code, not SIGKILL"; }; continue; }
    what=$(grep -m1 "^SPBCAST_WHAT" "$WORK/rank$rank.log" | cut -c14-)
    raised=$(grep -m1 "^SPBCAST_AT" "$WORK/rank$rank.log" | cut -c12-)
    took=$(( ${raised:-999999999} - killed ))
    echo "netns_test:   rank $rank: exit $code, raised $took ms after the kill: ${what:0:300}"
    if [ "$code" != 3 ] || [ "$took" -gt 1000 ] || [ "$took" -lt 0 ]; then status=1; fi
    case "$what" in *"rank 0 (RANK=0, host "*") exited"*) ;; *) status=1; echo "netns_test:   rank $rank did not name rank 0" ;; esac
    if [ "$rank" -ge 2 ]; then
        case "$what" in *"as its host's ranks tell"*) ;; *) status=1; echo "netns_test:   rank $rank: not from its store" ;; esac
    fi
done < <(sort -n "$WORK/exits")
[ $status = 0 ] || { show_logs; fail "a dead root was not named within 1 s on both hosts"; }

# ---- cut -------------------------------------------------------------------------------------
# Every rank's wait is bounded by options.timeout (+2 s grace in collective.hpp). A rank that
# is not waiting on the link itself (the root's neighbour on host A) waits on a peer that is,
# so the worst case is two such waits back to back, plus the step interval.
bound_ms=$(( 2 * (TIMEOUT_MS + 2000) + 3000 ))
echo "netns_test: cut link: options.timeout = $TIMEOUT_MS ms, every rank must fail within $(secs $bound_ms) s of the cut"
start_ranks 29500 steps=1000000 root=0 profile=text micro=1 timeout_ms="$TIMEOUT_MS" \
    group_timeout_ms=60000 interval_ms=100
begin=$(date +%s)
until [ "$(grep -c " ok digest " "$WORK/rank3.log" 2> /dev/null)" -ge 5 ]; do
    sleep 0.1
    if [ $(( $(date +%s) - begin )) -gt 120 ]; then show_logs; fail "ranks did not start broadcasting"; fi
done
cut=$(now_ms)
ip -n "$NS_A" link set "$VETH_A" down
echo "netns_test: link down after $(grep -c " ok digest " "$WORK/rank3.log") steps"
wait_ranks "$cut" 90 || { show_logs; cat "$WORK/exits"; fail "a rank hung after the link was cut"; }
while read -r rank code ms; do
    fault=$(grep -m1 "^SPBCAST_FAULT" "$WORK/rank$rank.log")
    what=$(grep -m1 "^SPBCAST_WHAT" "$WORK/rank$rank.log" | cut -c14-260)
    echo "netns_test:   rank $rank: exit $code after $(secs "$ms") s: ${fault#SPBCAST_FAULT }"
    echo "netns_test:     $what"
    if [ "$code" != 3 ]; then status=1; echo "netns_test:   rank $rank did not raise a spbcast error"; fi
    if [ "$ms" -gt "$bound_ms" ]; then status=1; echo "netns_test:   rank $rank took longer than $(secs $bound_ms) s"; fi
done < <(sort -n "$WORK/exits")
[ $status = 0 ] || { show_logs; fail "not every rank failed cleanly after the cut"; }
echo "netns_test: PASSED"
