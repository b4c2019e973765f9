// The same-host transfer mode of one broadcast (README: "The same-host path").
//
// The root copies every payload slot into one segment from its pool, hands the segment's
// descriptor to each follower over its socket, and only then sends the frame, whose body
// says where each slot lies in the segment. Followers map the segment privately and build
// their storages over the mapping; no payload collective runs. A follower that cannot use the
// segment (short, unsealed, out of order) says so with errc::corrupt_frame after the
// broadcast's remaining collectives, so the group stays in step.
#pragma once

#include "../error.hpp"
#include "bytes.hpp"
#include "collective.hpp"
#include "frame.hpp"
#include "receive_cache.hpp"
#include "send_plan.hpp"
#include "shm_channel.hpp"

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace spbcast::detail {

inline constexpr std::uint64_t segment_slot_alignment = 64;

// Where the payload lies: the frame body carries this right after the slot table.
struct segment_layout {
    std::uint64_t segment = 0;   // the root's id of the segment
    std::uint64_t capacity = 0;  // its size, as the follower must find it
    std::uint64_t used = 0;      // bytes the slots span, from the start
    std::vector<std::uint64_t> offsets;    // per transferred slot (not in the frame)
    std::vector<std::uint64_t> checksums;  // root only, with options.checksum: per transferred slot

    void write(byte_writer& out) const {
        out.put<std::uint64_t>(segment);
        out.put<std::uint64_t>(capacity);
        out.put<std::uint64_t>(used);
        for (auto o : offsets) out.put<std::uint64_t>(o);
    }
    // Validated against the slot table: every transferred slot inside `used`, `used` inside
    // `capacity`. Slots that ride in the frame have no place in the segment.
    static segment_layout read(byte_reader& in, const std::vector<slot_meta>& slots) {
        segment_layout l;
        l.segment = in.get<std::uint64_t>();
        l.capacity = in.get<std::uint64_t>();
        l.used = in.get<std::uint64_t>();
        if (l.used > l.capacity) in.fail("the segment's used bytes exceed its capacity");
        const std::uint32_t transferred = transferred_slot_count(slots);
        if (transferred > in.remaining() / 8) in.fail("segment offsets exceed the frame");
        l.offsets.resize(transferred);
        std::uint32_t k = 0;
        for (std::size_t i = 0; i < slots.size(); ++i) {
            if (slots[i].in_frame) continue;
            const std::uint64_t offset = l.offsets[k++] = in.get<std::uint64_t>();
            if (offset > l.used || slots[i].bytes > l.used - offset)
                in.fail("payload slot " + std::to_string(i + 1) + " lies outside the segment");
            if (offset % storage_alignment != 0) in.fail("misaligned payload slot in the segment");
        }
        return l;
    }
};

// Root: puts the payload of `plan` into a segment and hands it to every follower. Returns no
// layout (and the batch goes over the network) when no segment can be had.
inline std::optional<segment_layout> place_payload(same_host_state& state, const send_plan& plan,
                                                   std::uint64_t sequence, bool with_checksums) {
    const auto& slots = plan.slots();
    if (transferred_slot_count(slots) == 0) return std::nullopt;  // all in the frame, or nothing
    state.collect_releases();
    segment_layout layout;
    std::uint64_t end = 0;
    for (const auto& s : slots) {
        if (s.in_frame) continue;
        end = (end + segment_slot_alignment - 1) / segment_slot_alignment * segment_slot_alignment;
        layout.offsets.push_back(end);
        end += s.bytes;
    }
    layout.used = end;
    int holders = 0;
    for (const auto& l : state.links) holders += l.alive ? 1 : 0;
    if (holders == 0) return std::nullopt;
    auto& pool = shm_pool::instance();
    std::string why_not;
    const auto lease = pool.acquire(end, holders, why_not);
    if (!lease) return std::nullopt;
    try {
        std::uint32_t k = 0;
        for (std::uint32_t i = 0; i < slots.size(); ++i) {
            if (slots[i].in_frame) continue;
            std::uint8_t* out = lease.data + layout.offsets[k++];
            plan.pack_slot(i, out);
            if (with_checksums) layout.checksums.push_back(checksum64(out, slots[i].bytes));
        }
    } catch (...) {
        for (int h = 0; h < holders; ++h) pool.release(lease.id);
        throw;
    }
    layout.segment = lease.id;
    layout.capacity = lease.capacity;
    shm_message m;
    m.kind = shm_message_kind::segment;
    m.sequence = sequence;
    m.segment = lease.id;
    m.capacity = lease.capacity;
    for (auto& l : state.links) {
        if (!l.alive) continue;
        if (send_message(l.sock.get(), m, lease.fd)) {
            l.held.insert(lease.id);
        } else {
            // A follower that cannot be reached has died; the group reports it next.
            pool.release(lease.id);
            state.drop_link(l);
        }
    }
    return layout;
}

// Follower: the descriptor the root sent ahead of this frame, reported back as released
// unless a mapping takes it over.
struct segment_delivery {
    shm_message message;
    unique_fd fd;
    std::shared_ptr<follower_link> link;
    bool reported = false;

    segment_delivery() = default;
    segment_delivery(segment_delivery&&) = default;
    segment_delivery& operator=(segment_delivery&&) = default;
    ~segment_delivery() {
        if (link && !reported) link->report_released(message.segment);
    }
};

template <class Group>
segment_delivery take_segment(collective<Group>& c, same_host_state* state) {
    segment_delivery d;
    auto corrupt = [&](const std::string& what) {
        return error(errc::corrupt_frame,
                     c.where() + ": the frame announced a shared-memory segment, but " + what +
                         "; the root runs an incompatible spbcast - build every rank from the "
                         "same release, or set options.transport = transport_mode::network");
    };
    if (!state || !state->link) throw corrupt("this rank has no same-host channel to the root");
    const auto status = receive_message(state->link->socket(), d.message, d.fd, std::chrono::milliseconds(2000));
    if (status == receive_status::closed)
        throw transport_error(errc::transport,
                              c.where() + " failed in phase 'shared segment': the root's same-host "
                                          "socket closed - the root has probably died; the group is "
                                          "unusable now - restart the job",
                              "shared segment");
    if (status != receive_status::ok || d.message.kind != shm_message_kind::segment)
        throw corrupt("no segment descriptor arrived with it");
    d.link = state->link;
    return d;
}

// Maps the delivered segment and returns one uint8 tensor per transferred slot over the
// mapping (undefined for the slots in the frame); the
// descriptor is closed before returning. Throws errc::corrupt_frame for a segment that does
// not match the frame.
template <class Group>
std::vector<at::Tensor> map_segment(collective<Group>& c, segment_delivery& d, const segment_layout& layout,
                                    const std::vector<slot_meta>& slots, std::uint64_t header_sequence) {
    auto corrupt = [&](const std::string& what) {
        return error(errc::corrupt_frame,
                     c.where() + ": rejected the root's shared-memory segment: " + what +
                         "; this batch is lost on this rank, the group stays usable (if it "
                         "repeats, set options.transport = transport_mode::network)");
    };
    if (d.message.sequence != header_sequence)
        throw corrupt("it belongs to broadcast #" + std::to_string(d.message.sequence) + ", not #" +
                      std::to_string(header_sequence));
    if (d.message.segment != layout.segment || d.message.capacity != layout.capacity)
        throw corrupt("it is not the segment the frame describes");
    if (!d.fd) throw corrupt("no descriptor came with it");
    if (const std::string why = check_received_segment(d.fd.get(), layout.capacity); !why.empty())
        throw corrupt(why);
    const std::size_t bytes = (layout.used + segment_page - 1) / segment_page * segment_page;
    auto mapping = std::make_shared<shm_mapping>();
    mapping->data = map_private(d.fd.get(), bytes);
    if (bytes != 0 && !mapping->data) throw corrupt("mmap failed: " + errno_text(errno));
    mapping->bytes = bytes;
    mapping->segment = d.message.segment;
    mapping->link = d.link;
    d.reported = true;  // the mapping reports it when the last storage over it goes
    d.fd.reset();
    std::vector<at::Tensor> out(slots.size());  // undefined for the slots in the frame
    std::uint32_t k = 0;
    for (std::size_t i = 0; i < slots.size(); ++i) {
        if (slots[i].in_frame) continue;
        auto* keep = new std::shared_ptr<shm_mapping>(mapping);
        out[i] = byte_tensor_on(static_cast<std::uint8_t*>(mapping->data) + layout.offsets[k++],
                                static_cast<std::size_t>(slots[i].bytes), keep,
                                [](void* p) { delete static_cast<std::shared_ptr<shm_mapping>*>(p); });
    }
    return out;
}

}  // namespace spbcast::detail
