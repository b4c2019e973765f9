// The same-host transfer mode of one broadcast (docs/transports.md, "The same-host path").
//
// The root puts every payload slot into a segment: slots that are a tensor its loader already
// allocated in a segment of its own (shm_allocator.hpp) stay where they are, every other slot is
// copied into one segment from its pool. It hands the descriptors of those segments to each
// follower over its socket, in one message, and only then sends the frame, whose body says
// where each slot lies. Followers map the segments privately and build their storages over the
// mappings. The payload is complete before the frame leaves, so the frame is the whole
// broadcast: no payload collective, no status trailer. A follower that cannot use a segment
// (short, unsealed, out of order) raises errc::corrupt_frame on its own, and the group stays in
// step. Between hosts the payload travels by relay (relay.hpp), and the ranks there adopt their
// host leader's segments as here.
#pragma once

#include "../../error.hpp"
#include "../wire/bytes.hpp"
#include "collective.hpp"
#include "../wire/frame.hpp"
#include "receive_cache.hpp"
#include "../wire/send_plan.hpp"
#include "shm_allocator.hpp"
#include "descriptor_socket.hpp"
#include "follower_links.hpp"
#include "same_host_registry.hpp"
#include "shm_pool.hpp"
#include "shm_segment.hpp"

#include <ATen/ATen.h>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace spbcast::detail {

inline constexpr std::uint64_t segment_slot_alignment = 64;

// The relay chunk the root announces: options.relay_chunk_bytes within these bounds.
inline constexpr std::uint64_t min_relay_chunk_bytes = std::uint64_t{64} << 10;
inline constexpr std::uint64_t max_relay_chunk_bytes = std::uint64_t{1} << 30;
inline std::uint64_t relay_chunk_of(const options& opts) {
    return std::clamp<std::uint64_t>(opts.relay_chunk_bytes, min_relay_chunk_bytes, max_relay_chunk_bytes);
}

// Where the payload lies: the frame body carries this right after the slot table.
struct segment_layout {
    struct segment {
        std::uint64_t id = 0;        // the root's
        std::uint64_t capacity = 0;  // its size, as the follower must find it
        std::uint64_t used = 0;      // bytes the slots in it span, from the start
    };
    struct place {
        std::uint32_t segment = 0;  // index into segments
        std::uint64_t offset = 0;
    };
    std::vector<segment> segments;           // in the order of the descriptors handed over
    std::vector<place> places;               // per transferred slot (not in the frame)
    std::vector<std::uint64_t> checksums;    // with the checksum flag: per transferred slot
    std::uint64_t chunk_bytes = 0;           // the root's relay chunk (relay_chunk_of)

    void write(byte_writer& out) const {
        out.put<std::uint64_t>(chunk_bytes);
        out.put<std::uint32_t>(static_cast<std::uint32_t>(segments.size()));
        for (const auto& s : segments) {
            out.put<std::uint64_t>(s.id);
            out.put<std::uint64_t>(s.capacity);
            out.put<std::uint64_t>(s.used);
        }
        for (const auto& p : places) {
            out.put<std::uint32_t>(p.segment);
            out.put<std::uint64_t>(p.offset);
        }
        for (auto c : checksums) out.put<std::uint64_t>(c);
    }
    // Validated against the slot table: every transferred slot inside the bytes its segment
    // uses, those inside its capacity. Slots that ride in the frame have no place here.
    static segment_layout read(byte_reader& in, const std::vector<slot_meta>& slots, bool with_checksums) {
        segment_layout l;
        l.chunk_bytes = in.get<std::uint64_t>();
        if (l.chunk_bytes < min_relay_chunk_bytes || l.chunk_bytes > max_relay_chunk_bytes)
            in.fail("the relay chunk of " + std::to_string(l.chunk_bytes) + " bytes is out of range");
        const auto count = in.get<std::uint32_t>();
        if (count == 0 || count > max_batch_segments) in.fail("the frame names " + std::to_string(count) + " segments");
        l.segments.resize(count);
        for (auto& s : l.segments) {
            s.id = in.get<std::uint64_t>();
            s.capacity = in.get<std::uint64_t>();
            s.used = in.get<std::uint64_t>();
            if (s.used > s.capacity) in.fail("a segment's used bytes exceed its capacity");
        }
        const std::uint32_t transferred = transferred_slot_count(slots);
        if (transferred > in.remaining() / 12) in.fail("segment places exceed the frame");
        l.places.resize(transferred);
        std::uint32_t k = 0;
        for (std::size_t i = 0; i < slots.size(); ++i) {
            if (slots[i].in_frame) continue;
            place& p = l.places[k++];
            p.segment = in.get<std::uint32_t>();
            p.offset = in.get<std::uint64_t>();
            if (p.segment >= count) in.fail("payload slot " + std::to_string(i + 1) + " names no segment of the frame");
            const std::uint64_t used = l.segments[p.segment].used;
            if (p.offset > used || slots[i].bytes > used - p.offset)
                in.fail("payload slot " + std::to_string(i + 1) + " lies outside its segment");
            if (p.offset % storage_alignment != 0) in.fail("misaligned payload slot in the segment");
        }
        if (with_checksums)
            for (std::uint32_t j = 0; j < transferred; ++j) l.checksums.push_back(in.get<std::uint64_t>());
        return l;
    }
};

// Buckets up to this size ride in the frame on the same-host path (one or two small
// collectives), so a small batch costs no segment: a follower that keeps many small batches
// pins no descriptor or segment on the root.
inline constexpr std::uint64_t same_host_frame_bytes = std::uint64_t{64} << 10;

// Where the root's payload goes: slots that are a tensor of the root's own in a segment stay
// there (kept), the others are copied into the batch's segment at copy_offset.
struct segment_plan {
    std::vector<shared_allocation*> kept;
    std::vector<std::uint64_t> copy_offset;
    std::uint64_t copied_bytes = 0;
    bool copies = false;

    // `keep`: shared allocations of the root's own may stay where they are (they are handed
    // over); else every slot is copied.
    segment_plan(const send_plan& plan, bool keep) : kept(plan.slots().size(), nullptr), copy_offset(plan.slots().size(), 0) {
        const auto& slots = plan.slots();
        std::size_t kept_count = 0;
        for (std::uint32_t i = 0; i < slots.size(); ++i) {
            if (slots[i].in_frame) continue;
            if (keep && slots[i].in_place && kept_count + 1 < max_batch_segments) {
                shared_allocation* a = shared_allocation_of(plan.in_place_source(i).storage);
                if (a && !a->detached && a->detach()) {
                    kept[i] = a;
                    ++kept_count;
                    continue;
                }
            }
            copies = true;
            copied_bytes = (copied_bytes + segment_slot_alignment - 1) / segment_slot_alignment * segment_slot_alignment;
            if (slots[i].in_place) {
                // A large slot is one memcpy from its storage, which runs up to 3x slower when the
                // destination lies just past the source modulo a page (the CPU takes the stores
                // for the loads' 4 KiB aliases; measured: 0.65 s against 0.2 s for 2.25 GiB). Its
                // place in the (page-aligned) segment takes the source's offset within a page.
                const auto& source = plan.in_place_source(i);
                const auto page_offset = reinterpret_cast<std::uintptr_t>(source.base + source.lo) % segment_page;
                if (page_offset % storage_alignment == 0)
                    copied_bytes += (page_offset + segment_page - copied_bytes % segment_page) % segment_page;
            }
            copy_offset[i] = copied_bytes;
            copied_bytes += slots[i].bytes;
        }
    }
};

// Root: fills the batch's segment and describes every segment. The descriptors go in this
// order: the batch's segment, then the kept ones in slot order. `pieces`: the bytes of each
// segment the frame describes, for the relay to other hosts.
inline segment_layout fill_segments(const send_plan& plan, const segment_plan& where, const shm_pool::lease& lease,
                                    int holders, bool with_checksums, std::vector<int>& fds,
                                    std::vector<at::Tensor>& pieces) {
    const auto& slots = plan.slots();
    auto& pool = shm_pool::instance();
    segment_layout layout;
    // A kept segment's bytes keep the root's storage alive (a failed relay quarantines them).
    auto bytes_of = [](void* data, std::uint64_t used, c10::Storage owner = {}) {
        return at::from_blob(data, {static_cast<std::int64_t>(used)}, [owner](void*) {}, at::kByte);
    };
    if (where.copies) {
        layout.segments.push_back({lease.id, lease.capacity, where.copied_bytes});
        fds.push_back(lease.fd);
        pieces.push_back(bytes_of(lease.data, where.copied_bytes));
    }
    for (std::uint32_t i = 0; i < slots.size(); ++i) {
        if (slots[i].in_frame) continue;
        shared_allocation* kept = where.kept[i];
        if (!kept) {
            layout.places.push_back({0, where.copy_offset[i]});
            continue;
        }
        const std::uint64_t offset = plan.in_place_source(i).lo;
        layout.places.push_back({static_cast<std::uint32_t>(layout.segments.size()), offset});
        layout.segments.push_back({kept->segment, kept->capacity, offset + slots[i].bytes});
        fds.push_back(kept->fd);
        pieces.push_back(bytes_of(kept->data, offset + slots[i].bytes, plan.in_place_source(i).storage));
        pool.hold(kept->segment, holders);
        pool.count_tensor(true);
    }
    try {
        for (std::uint32_t i = 0, k = 0; i < slots.size(); ++i) {
            if (slots[i].in_frame) continue;
            const auto& p = layout.places[k++];
            shared_allocation* kept = where.kept[i];
            std::uint8_t* at = kept ? static_cast<std::uint8_t*>(kept->data) + p.offset : lease.data + p.offset;
            if (!kept) plan.pack_slot(i, at);
            if (with_checksums) layout.checksums.push_back(checksum64(at, slots[i].bytes));
        }
    } catch (...) {
        for (const auto& s : layout.segments)
            for (int h = 0; h < holders; ++h) pool.release_follower(s.id);
        throw;
    }
    return layout;
}

// Root: hands the segments to every follower, in the message that answers broadcast
// `sequence`. A follower that cannot take it within options.timeout is lost: false, and the
// caller ends the path (state.lost says why).
inline bool hand_over(same_host_state& state, const segment_layout& layout, const std::vector<int>& fds,
                      std::uint64_t sequence, std::chrono::milliseconds timeout) {
    shm_message m;
    m.kind = shm_message_kind::segments;
    m.sequence = sequence;
    for (const auto& s : layout.segments) m.ids[m.count++] = s.id;
    m.descriptors = m.count;
    if (!layout.segments.empty()) m.capacity = layout.segments.front().capacity;
    // Failed links are dropped after every follower was served: dropping one forgets the
    // segments, which closes the descriptors being sent.
    std::vector<std::pair<root_link*, send_status>> failed;
    for (auto& l : state.links) {
        if (!l.alive) continue;
        for (const auto& s : layout.segments) l.held.insert(s.id);  // forgotten with the link if it fails
        const auto status = send_message(l.sock.get(), m, fds, timeout);
        if (status != send_status::sent) failed.emplace_back(&l, status);
    }
    for (auto [l, status] : failed)
        state.drop_link(*l, status == send_status::would_block ? "its socket stayed full for options.timeout"
                                                               : "its socket closed");
    return state.lost.empty();
}

// The root's payload once placed: the layout the frame carries and, for the relay to other
// hosts, the bytes of each of its segments. The batch's segment stays held until relayed.
struct placed_payload {
    struct hold {  // one holder of a pool segment, released with it
        std::optional<std::uint64_t> id;
        hold() = default;
        hold(hold&& o) noexcept : id(std::exchange(o.id, std::nullopt)) {}
        hold& operator=(hold&& o) noexcept {
            std::swap(id, o.id);
            return *this;
        }
        ~hold() {
            if (id) shm_pool::instance().release_follower(*id);
        }
    };
    segment_layout layout;
    std::vector<at::Tensor> pieces;
    hold held;
};

// Root: puts the payload of `plan` into segments and hands them to every follower of its host.
// Returns nothing (and the batch goes over the network) when no segment can be had or a link
// was lost. A root alone on its host that relays copies the payload into memory of its own.
inline std::optional<placed_payload> place_payload(same_host_state& state, const send_plan& plan,
                                                   std::uint64_t sequence, const options& opts) {
    if (transferred_slot_count(plan.slots()) == 0 || (state.links.empty() && !state.relays())) return std::nullopt;
    placed_payload placed;
    if (state.links.empty()) {
        const segment_plan where(plan, false);
        at::Tensor buffer = at::empty({static_cast<std::int64_t>(where.copied_bytes)}, at::kByte);
        placed.layout.segments.push_back({0, where.copied_bytes, where.copied_bytes});
        for (std::uint32_t i = 0; i < plan.slots().size(); ++i) {
            if (plan.slots()[i].in_frame) continue;
            auto* at = buffer.data_ptr<std::uint8_t>() + where.copy_offset[i];
            plan.pack_slot(i, at);
            placed.layout.places.push_back({0, where.copy_offset[i]});
            if (opts.checksum) placed.layout.checksums.push_back(checksum64(at, plan.slots()[i].bytes));
        }
        placed.layout.chunk_bytes = relay_chunk_of(opts);
        placed.pieces.push_back(buffer);
        return placed;
    }
    const int holders = static_cast<int>(state.links.size());
    auto& pool = shm_pool::instance();
    pool.next_batch();
    const segment_plan where(plan, true);
    shm_pool::lease lease;
    if (where.copies) {
        // Released segments come back before the batch is placed: with no free segment that
        // fits but one the followers still map, the root waits (a quarter of options.timeout at
        // most) for each follower to start this broadcast - after reporting what it let go of -
        // so a loop that keeps batch t while t + 1 arrives refills t - 1's segment instead of
        // making a third. The root waits for the followers at the frame anyway.
        const auto free_fit = [&] { return pool.fit_for(where.copied_bytes) == shm_pool::fit::free; };
        if (pool.fit_for(where.copied_bytes) == shm_pool::fit::held)
            state.await_followers(sequence, opts.timeout / 4, free_fit);
        if (!state.lost.empty()) return std::nullopt;  // a follower is gone: the path ends (send.hpp)
        std::string why_not;
        lease = pool.acquire_for_batch(where.copied_bytes, holders + (state.relays() ? 1 : 0), why_not);
        if (!lease) {
            // The tensors kept above go over the network too, intact: nothing of them has left.
            pool.count_network_fallback();
            return std::nullopt;
        }
        if (state.relays()) placed.held.id = lease.id;
    }
    std::vector<int> fds;
    placed.layout = fill_segments(plan, where, lease, holders, opts.checksum, fds, placed.pieces);
    placed.layout.chunk_bytes = relay_chunk_of(opts);
    std::size_t segment_bytes = 0;  // the pool's free-bytes bound follows the largest batch
    for (const auto& s : placed.layout.segments) segment_bytes += static_cast<std::size_t>(s.capacity);
    pool.note_batch(segment_bytes);
    if (!hand_over(state, placed.layout, fds, sequence, opts.timeout)) return std::nullopt;
    return placed;
}

// Follower: the descriptors the root sent ahead of this frame; each is reported back as
// released unless a mapping takes it over.
struct segment_delivery {
    shm_message message;
    std::vector<owned_fd> fds;  // one per message.ids
    std::vector<bool> mapped;
    std::shared_ptr<follower_link> link;

    segment_delivery() = default;
    segment_delivery(segment_delivery&&) = default;
    segment_delivery& operator=(segment_delivery&&) = default;
    ~segment_delivery() { release_unmapped(); }

    void release_unmapped() {
        if (!link) return;
        for (std::uint32_t i = 0; i < message.count; ++i)
            if (i >= mapped.size() || !mapped[i]) link->report(message.ids[i], false);
        link.reset();
    }
};

// Follower: takes the message that answers the frame of broadcast `sequence` off the socket.
// The stream is always in step with the frames: a message for an earlier broadcast (one this
// rank did not take, a network call of its own) is stale - released unmapped and skipped.
// Anything else that does not answer this frame ends this rank's link (the root sees it close
// and ends the path for every rank at its next broadcast).
// On a host other than the root's the segments come from the host leader, which only the root's
// frames keep in step: a stream that lost step there leaves this rank out of the group for good.
template <class Group>
segment_delivery take_segments(collective<Group>& c, same_host_state* state, std::uint64_t sequence) {
    const bool relayed = state && state->relays() && state->leader != c.opts().root;
    const std::string peer = relayed ? "host leader (rank " + std::to_string(state->leader) + ")" : "root";
    auto lost = [&](const std::string& what) {
        const std::string why = c.where() + ": the frame announced shared-memory segments, but " + what;
        if (relayed)
            c.break_group(errc::transport, why + "; this rank cannot take the relayed batches any more - restart the job",
                          "shared segment");
        if (state) state->end_path(why);
        return error(errc::corrupt_frame, why + "; this batch is lost on this rank, and the group takes the network "
                                                "path from the root's next broadcast on");
    };
    if (!state || !state->link) throw lost("this rank has no same-host channel to the " + peer);
    std::uint64_t chunks_landed = 0;
    // A relaying leader reports a failed chunk within options.timeout and the backend's grace
    // (collective.hpp): its followers wait longer, to raise what it found, not a timeout.
    const auto wait = relayed ? c.opts().timeout + 2 * wait_grace : c.opts().timeout;
    for (;;) {
        segment_delivery d;
        const auto status = receive_message(state->link->socket(), d.message, d.fds, wait);
        if (status == receive_status::closed)
            throw transport_error(errc::transport,
                                  c.where() + " failed in phase 'shared segment': the " + peer +
                                      "'s same-host socket closed - it has probably died; the group is "
                                      "unusable now - restart the job",
                                  "shared segment");
        if (status == receive_status::timed_out)
            throw lost(relayed && chunks_landed > 0
                           ? "no further relayed chunk reached the " + peer + " within options.timeout (" +
                                 std::to_string(chunks_landed) + " had)"
                           : "no segment descriptors arrived within options.timeout");
        const auto kind = d.message.kind;
        if (status == receive_status::ok &&
            (kind == shm_message_kind::relay_progress || kind == shm_message_kind::relay_failed)) {
            // Another broadcast's report, or the root's about an earlier relay (one this rank
            // refused or left early): stale.
            if (!relayed || d.message.sequence != sequence) continue;
            if (kind == shm_message_kind::relay_progress) {
                chunks_landed = d.message.capacity;  // the leader is relaying: a fresh wait
                continue;
            }
            c.break_group(errc::transport,
                          c.where() + ": the " + peer + " is alive but could not relay this batch to this host: " +
                              relay_failure_text(d.message) + " - restart the job",
                          "shared segment");
        }
        if (status == receive_status::malformed || kind != shm_message_kind::segments)
            throw lost("the " + peer + "'s socket delivered a malformed message");
        d.link = state->link;
        if (d.message.sequence < sequence) continue;  // stale: released as d goes
        if (d.message.sequence > sequence)
            throw lost("the descriptors belong to broadcast #" + std::to_string(d.message.sequence));
        if (status == receive_status::truncated) {
            rlimit limit{};
            ::getrlimit(RLIMIT_NOFILE, &limit);
            throw error(errc::limit_exceeded,
                        c.where() + ": the root's shared-memory segments arrived without their descriptors: "
                                    "this process is at its descriptor limit (RLIMIT_NOFILE soft limit " +
                            std::to_string(limit.rlim_cur) +
                            "); this batch is lost on this rank, the group stays usable - raise the limit "
                            "(ulimit -n) or close descriptors");
        }
        d.mapped.assign(d.fds.size(), false);
        return d;
    }
}
// One uint8 tensor per transferred slot over `mappings`, where `layout` places it (undefined for
// the slots in the frame); each keeps its mapping alive.
inline std::vector<at::Tensor> slots_over(const std::vector<std::shared_ptr<shm_mapping>>& mappings,
                                          const segment_layout& layout, const std::vector<slot_meta>& slots) {
    std::vector<at::Tensor> out(slots.size());
    std::uint32_t k = 0;
    for (std::size_t i = 0; i < slots.size(); ++i) {
        if (slots[i].in_frame) continue;
        const auto& place = layout.places[k++];
        const auto& mapping = mappings[place.segment];
        auto* keep = new std::shared_ptr<shm_mapping>(mapping);
        out[i] = byte_tensor_on(static_cast<std::uint8_t*>(mapping->data) + place.offset,
                                static_cast<std::size_t>(slots[i].bytes), keep,
                                [](void* p) { delete static_cast<std::shared_ptr<shm_mapping>*>(p); });
    }
    return out;
}

// Maps the delivered segments and returns one uint8 tensor per transferred slot over the
// mappings (undefined for the slots in the frame); the descriptors are closed before
// returning. Throws errc::corrupt_frame for segments that do not match the frame.
template <class Group>
std::vector<at::Tensor> map_segments(collective<Group>& c, segment_delivery& d, const segment_layout& layout,
                                     const std::vector<slot_meta>& slots) {
    auto corrupt = [&](const std::string& what) {
        return error(errc::corrupt_frame,
                     c.where() + ": rejected the root's shared-memory segment: " + what +
                         "; this batch is lost on this rank, the group stays usable (if it "
                         "repeats, set options.transport = transport_mode::network)");
    };
    if (d.fds.size() != layout.segments.size())
        throw corrupt(std::to_string(d.fds.size()) + " descriptors came for the frame's " +
                      std::to_string(layout.segments.size()) + " segments");
    std::vector<std::shared_ptr<shm_mapping>> mappings;
    for (std::size_t j = 0; j < layout.segments.size(); ++j) {
        const auto& segment = layout.segments[j];
        if (d.message.ids[j] != segment.id) throw corrupt("it is not the segment the frame describes");
        if (const std::string why = check_received_segment(d.fds[j].get(), segment.capacity); !why.empty())
            throw corrupt(why);
        const std::size_t bytes = (segment.used + segment_page - 1) / segment_page * segment_page;
        auto mapping = std::make_shared<shm_mapping>();
        mapping->data = map_private(d.fds[j].get(), bytes);
        if (bytes != 0 && !mapping->data) throw corrupt("mmap failed: " + errno_text(errno));
        mapping->bytes = bytes;
        mapping->segment = segment.id;
        mapping->link = d.link;
        d.mapped[j] = true;  // the mapping reports it when the last storage over it goes
        mappings.push_back(std::move(mapping));
    }
    d.fds.clear();
    return slots_over(mappings, layout, slots);
}

}  // namespace spbcast::detail
