// The relay between hosts. The hosts form a chain in the order of same_host_state::hosts (the
// root's first); each host leader receives the used bytes of the root's segments from the one
// before it, chunk by chunk, and forwards every chunk to the one after it as soon as it has
// landed, so each link carries one copy and a batch of B bytes over H hosts takes about
// (B + (H - 2) C) / b at link rate b and chunk C. Every message is bounded by options.timeout.
// A host leader elsewhere places what it receives in a segment of its own pool and hands it to
// its host as a root does (same_host.hpp), and adopts its own slots over a private mapping as a
// follower does.
#pragma once

#include "../../error.hpp"
#include "../base/exception_text.hpp"
#include "../wire/bytes.hpp"
#include "../wire/frame.hpp"
#include "../wire/wire_tables.hpp"
#include "collective.hpp"
#include "descriptor_socket.hpp"
#include "follower_links.hpp"
#include "receive_cache.hpp"
#include "same_host.hpp"
#include "same_host_registry.hpp"
#include "shm_pool.hpp"
#include "shm_segment.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace spbcast::detail {

// Where the relayed payload lies on a host other than the root's, and the chunks that carry it:
// the bytes of the root's segments that the slots use (from the first slot in a segment, so a
// view of a large leader-allocated storage sends only what it uses), one after the other
// (aligned) in one segment of that host's leader. Its id and size come with the leader's
// message (id and capacity stay 0 in `local`).
struct relay_plan {
    struct chunk {
        std::uint32_t segment = 0;     // of the root's layout
        std::uint64_t source = 0;      // offset in that segment
        std::uint64_t local = 0;       // offset in the host's segment
        std::uint64_t bytes = 0;
    };
    segment_layout local;
    std::vector<chunk> chunks;
    std::uint64_t total() const { return local.segments[0].used; }
    std::uint64_t largest_chunk() const {
        std::uint64_t most = 0;
        for (const auto& c : chunks) most = std::max(most, c.bytes);
        return most;
    }

    explicit relay_plan(const segment_layout& source) {
        std::vector<std::uint64_t> first(source.segments.size(), std::numeric_limits<std::uint64_t>::max());
        for (const auto& p : source.places) first[p.segment] = std::min(first[p.segment], p.offset);
        std::vector<std::uint64_t> base(source.segments.size(), 0);
        std::uint64_t total = 0;
        const std::uint64_t step = std::max<std::uint64_t>(source.chunk_bytes, 1);
        for (std::uint32_t j = 0; j < source.segments.size(); ++j) {
            const std::uint64_t used = source.segments[j].used;
            first[j] = std::min(first[j], used) / segment_slot_alignment * segment_slot_alignment;
            total = (total + segment_slot_alignment - 1) / segment_slot_alignment * segment_slot_alignment;
            base[j] = total;
            for (std::uint64_t at = first[j]; at < used; at += step)
                chunks.push_back({j, at, total + (at - first[j]), std::min(step, used - at)});
            total += used - first[j];
        }
        local.segments.push_back({0, 0, total});
        for (const auto& p : source.places) local.places.push_back({0, base[p.segment] + (p.offset - first[p.segment])});
        local.checksums = source.checksums;
        local.chunk_bytes = source.chunk_bytes;
    }
};

// The host leaders before and after `rank` in the relay chain (-1: none).
inline std::pair<int, int> relay_neighbours(const same_host_state& state, int rank) {
    const auto& hosts = state.hosts;
    for (std::size_t i = 0; i < hosts.size(); ++i)
        if (hosts[i].leader == rank)
            return {i > 0 ? hosts[i - 1].leader : -1, i + 1 < hosts.size() ? hosts[i + 1].leader : -1};
    return {-1, -1};
}

inline std::string relay_phase(std::size_t k, std::size_t chunks, int from, int to, int root) {
    auto who = [root](int r) { return "rank " + std::to_string(r) + (r == root ? " (the root)" : " (host leader)"); };
    return "relay chunk " + std::to_string(k + 1) + "/" + std::to_string(chunks) + " from " + who(from) + " to " + who(to);
}

// A host leader (the root included): tells the ranks of its host how the relay goes. Without a
// bound it does not wait (a follower that is not listening now needs no progress report); the
// root's last report, which its followers wait for, waits up to `bound`. `total`: the relay's
// chunk count, in the root's reports only.
inline void tell_followers(same_host_state& state, shm_message_kind kind, std::uint64_t sequence,
                           std::uint64_t chunks, const std::string& text = {}, std::uint64_t total = 0,
                           std::chrono::milliseconds bound = std::chrono::milliseconds(-1)) {
    shm_message m;
    m.kind = kind;
    m.sequence = sequence;
    m.capacity = chunks;
    std::memcpy(m.ids, text.data(), std::min(text.size(), sizeof m.ids - 1));
    if (text.empty()) m.ids[0] = total;
    for (auto& l : state.links)
        if (l.alive) send_message(l.sock.get(), m, {}, bound);
}

// Root, after the frame: the used bytes of every segment the frame describes go to the next
// host's leader, chunk by chunk. The followers of the root's host, which hold their batch
// already, hear how the relay goes (at least every options.timeout / 4 and at its end), so none
// of them waits for the whole relay in one wait: the root's next frame comes only after it.
template <class Group>
void relay_to_hosts(collective<Group>& c, same_host_state& state, const segment_layout& layout,
                    const std::vector<at::Tensor>& pieces, std::uint64_t sequence) {
    const int root = c.opts().root, next = relay_neighbours(state, root).second;
    if (next < 0) return;
    const relay_plan plan(layout);
    const std::uint64_t n = plan.chunks.size();
    const auto every = c.opts().timeout / 4;
    try {
        std::vector<std::size_t> sent(n);
        for (std::size_t k = 0; k < n; ++k) {
            const auto& chunk = plan.chunks[k];
            sent[k] = c.launched();
            c.launch_point_to_point(pieces[chunk.segment].narrow(0, static_cast<std::int64_t>(chunk.source),
                                                                 static_cast<std::int64_t>(chunk.bytes)),
                                    next, true, relay_phase(k, n, root, next, root));
        }
        auto reported = std::chrono::steady_clock::now();
        for (std::size_t k = 0; k < n; ++k) {
            c.wait_through(sent[k]);
            const auto now = std::chrono::steady_clock::now();
            if (k + 1 == n) {
                c.wait_all();
                tell_followers(state, shm_message_kind::relay_progress, sequence, n, {}, n, c.opts().timeout);
            } else if (now - reported >= every) {
                tell_followers(state, shm_message_kind::relay_progress, sequence, k + 1, {}, n);
                reported = now;
            }
        }
    } catch (const std::exception& e) {
        tell_followers(state, shm_message_kind::relay_failed, sequence, 0, e.what(), n, c.opts().timeout);
        throw;
    }
}

// A follower on the root's host, once it holds a relayed batch: waits for the root's reports
// until the relay is out, each report within options.timeout (and the grace the root's own
// wait for a chunk may take), so its next broadcast waits for the root's next batch, not for
// this relay. A relay that failed breaks the group with the root's message; this rank is alive.
template <class Group>
void await_root_relay(collective<Group>& c, same_host_state& state, std::uint64_t sequence) {
    if (!state.link) return;
    const auto wait = c.opts().timeout + 2 * wait_grace;
    std::uint64_t sent = 0;
    for (;;) {
        shm_message m;
        std::vector<owned_fd> fds;
        const auto status = receive_message(state.link->socket(), m, fds, wait);
        const std::string progress = " (" + std::to_string(sent) + " chunks had left)";
        if (status == receive_status::closed)
            c.break_group(errc::transport,
                          c.where() + ": the root's same-host socket closed while it relayed this batch to the other "
                                      "hosts" + progress + " - it has probably died; restart the job",
                          "relay");
        if (status == receive_status::timed_out)
            c.break_group(errc::timeout,
                          c.where() + ": the root reported no further relay chunk sent to the next host within "
                                      "options.timeout" + progress + " - a peer is gone or stalled; restart the job",
                          "relay");
        if (status != receive_status::ok ||
            (m.kind != shm_message_kind::relay_progress && m.kind != shm_message_kind::relay_failed))
            c.break_group(errc::out_of_step,
                          c.where() + ": the root's same-host socket delivered something other than a relay report "
                                      "while it relayed this batch; restart the job",
                          "relay");
        if (m.sequence != sequence) continue;  // an earlier batch's: stale
        if (m.kind == shm_message_kind::relay_failed)
            c.break_group(errc::transport,
                          c.where() + ": the root is alive but could not relay this batch to the other hosts: " +
                              relay_failure_text(m) + " - restart the job",
                          "relay");
        sent = m.capacity;
        if (m.ids[0] != 0 && sent >= m.ids[0]) return;
    }
}

// Host leader: receives the relay chunks from the host leader before it in the chain into
// `memory` (or, undefined, through `scratch`, which holds relay_scratch_chunks chunks), forwards
// each to the one after it once it has landed, and tells its followers. A failure is told to
// the followers (this rank is alive; the message names the rank that is not) and raised.
inline constexpr std::size_t relay_scratch_chunks = 4;
template <class Group>
void relay_chunks(collective<Group>& c, same_host_state& state, const relay_plan& plan, std::uint64_t sequence,
                  const at::Tensor& memory, const at::Tensor& scratch) {
    const int root = c.opts().root, me = c.rank();
    // Plain variables, not a structured binding: the lambdas below capture them, which clang
    // before 16 refuses for bindings (the fuzz tree builds with clang 14).
    const std::pair<int, int> neighbours = relay_neighbours(state, me);
    const int from = neighbours.first, to = neighbours.second;
    const std::size_t n = plan.chunks.size();
    // At most two receives ahead and two sends behind: with the chunk scratch, the slot a
    // receive reuses was sent two chunks before the one just waited for.
    constexpr std::size_t ahead = 2, in_flight = 2 * ahead + 1;
    auto buffer = [&](std::size_t k) {
        const auto& chunk = plan.chunks[k];
        const auto at = memory.defined() ? chunk.local : (k % relay_scratch_chunks) * plan.largest_chunk();
        return (memory.defined() ? memory : scratch).narrow(0, static_cast<std::int64_t>(at), static_cast<std::int64_t>(chunk.bytes));
    };
    std::vector<std::size_t> received(n);
    auto receive = [&](std::size_t k) {
        received[k] = c.launched();
        c.launch_point_to_point(buffer(k), from, false, relay_phase(k, n, from, me, root), in_flight);
    };
    try {
        for (std::size_t k = 0; k < std::min(ahead, n); ++k) receive(k);
        for (std::size_t k = 0; k < n; ++k) {
            c.wait_through(received[k]);
            tell_followers(state, shm_message_kind::relay_progress, sequence, k + 1);
            if (to >= 0) c.launch_point_to_point(buffer(k), to, true, relay_phase(k, n, me, to, root), in_flight);
            if (k + ahead < n) receive(k + ahead);
        }
        c.wait_all();
    } catch (const std::exception& e) {
        tell_followers(state, shm_message_kind::relay_failed, sequence, 0, e.what());
        throw;
    }
}

// A host leader other than the root, right after the frame of a relayed batch: receives the
// relayed bytes (relay_chunks) into one segment of its own pool (with no rank of its host to
// serve, into memory of its own), hands that segment to its host and returns its own slot
// tensors, over a private mapping like a follower's. Every announced message is received (and
// forwarded) whatever happens, so the group stays in step; a batch it cannot place is this
// host's error for this batch only (`failure` here, an empty message for its followers).
template <class Group>
std::vector<at::Tensor> relay_in(collective<Group>& c, same_host_state& state, const frame_header& header,
                                 const std::vector<std::uint8_t>& body, const std::vector<slot_meta>& slots,
                                 std::exception_ptr& failure) {
    segment_layout source;
    try {
        if (header.version != format_version) throw error(errc::version_mismatch, c.where() + ": another wire format");
        byte_reader in(body.data(), body.size(), c.where() + ": corrupt frame");
        read_slots(in);
        source = segment_layout::read(in, slots, header.flags & payload_checksums);
    } catch (const spbcast::error& e) {
        tell_followers(state, shm_message_kind::relay_failed, header.sequence, 0, e.what());
        c.break_group(errc::corrupt_frame,
                      std::string(e.what()) + "; this host leader cannot tell what the root relays - restart the job",
                      "relay");
    }
    const relay_plan plan(source);
    segment_layout local = plan.local;
    const std::uint64_t total = plan.total();
    auto& pool = shm_pool::instance();
    shm_pool::lease lease;
    at::Tensor memory;  // where the relayed bytes land; undefined: drained
    std::string why;
    state.collect_releases();  // what its followers let go of since this broadcast began
    const int followers = state.alive_links();
    if (followers > 0) {
        pool.next_batch();
        lease = pool.acquire_for_batch(total, followers + 1, why);
        if (lease) {
            memory = at::from_blob(lease.data, {static_cast<std::int64_t>(total)}, at::kByte);
            pool.note_batch(lease.capacity);
        }
    } else if (total <= c.opts().limits.max_payload_bytes) {
        try {
            receive_cache::instance().begin_batch();  // a batch of its own: the cache's budget follows it
            memory = receive_cache::instance().allocate(total);
        } catch (const std::exception& e) {
            why = exception_text(e);
        }
    } else {
        why = "the batch exceeds limits.max_payload_bytes";
    }
    // Until the relay is in, a failure leaves the segment to the backend (shm_pool::abandon).
    struct abandon_on_failure {
        const shm_pool::lease& lease;
        bool armed = true;
        ~abandon_on_failure() {
            if (armed && lease) shm_pool::instance().abandon(lease.id);
        }
    } guard{lease};
    at::Tensor scratch;
    if (!memory.defined()) {
        try {
            const auto slots_needed = std::min<std::size_t>(relay_scratch_chunks, plan.chunks.size());
            scratch = at::empty({static_cast<std::int64_t>(slots_needed * plan.largest_chunk())}, at::kByte);
        } catch (const std::exception& e) {
            tell_followers(state, shm_message_kind::relay_failed, header.sequence, 0, exception_text(e));
            c.break_group(errc::limit_exceeded, c.where() + ": cannot drain the relayed batch (" + exception_text(e) +
                                                    "); the group is out of step - restart the job", "relay");
        }
    }
    relay_chunks(c, state, plan, header.sequence, memory, scratch);
    guard.armed = false;
    // Its own mapping first: handing over may forget the segment (a follower that is gone),
    // which closes the pool's descriptor.
    std::shared_ptr<shm_mapping> mapping;
    if (lease) {
        mapping = std::make_shared<shm_mapping>();
        mapping->local = true;
        mapping->segment = lease.id;
        const auto bytes = static_cast<std::size_t>((total + segment_page - 1) / segment_page * segment_page);
        mapping->data = map_private(lease.fd, bytes);
        mapping->bytes = mapping->data ? bytes : 0;
        if (bytes != 0 && !mapping->data)
            failure = std::make_exception_ptr(error(
                errc::limit_exceeded, c.where() + ": this host leader cannot map its segment of the relayed batch (" +
                                          errno_text(errno) + "); this batch is lost on this rank, the group stays usable"));
    }
    if (followers > 0) {
        if (lease) {
            local.segments[0].id = lease.id;
            local.segments[0].capacity = lease.capacity;
            hand_over(state, local, {lease.fd}, header.sequence, c.opts().timeout);
        } else {
            hand_over(state, {}, {}, header.sequence, c.opts().timeout);  // no segment: lost on this host
        }
        state.lost.clear();  // as in receive()
    }
    if (!memory.defined()) {
        failure = std::make_exception_ptr(error(
            errc::limit_exceeded, c.where() + ": this host leader could not place the relayed batch (" + why +
                                      "); this batch is lost on this host, the group stays usable"));
        return {};
    }
    if (failure) return {};
    if (!lease) {
        std::vector<at::Tensor> out(slots.size());
        for (std::size_t i = 0, k = 0; i < slots.size(); ++i)
            if (!slots[i].in_frame) out[i] = storage_within(memory, local.places[k++].offset, slots[i].bytes);
        return out;
    }
    return slots_over({mapping}, local, slots);
}

}  // namespace spbcast::detail
