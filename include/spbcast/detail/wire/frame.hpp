// The fixed 64-byte frame header and the status trailer (see docs/wire-format.md). The first
// collective of every broadcast carries the header together with the start of the body in a
// fixed-size message; from the header and the slot table every rank knows the whole sequence
// of collectives that follows, and issues exactly that sequence whatever it finds.
#pragma once

#include "../../options.hpp"
#include "bytes.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace spbcast::detail {

inline constexpr std::uint32_t frame_magic = 0x43425053;  // "SPBC" in little-endian bytes
inline constexpr std::uint16_t format_version = 8;
inline constexpr std::size_t inline_frame_bytes = 8192;  // header + first body bytes

// keep_alive: the root is still producing its batch; the real frame follows (keep_alive.hpp).
// same_host_offer: the first message of the same-host handshake (handshake.hpp), shaped like a
// frame so that a follower receives it after any keep-alive frames, as it would a frame.
enum class frame_status : std::uint16_t { ok = 0, error = 1, keep_alive = 2, same_host_offer = 3 };
// payload_checksums: the root sends a checksum per transferred slot (in the status trailer, or
// in the segment layout). shared_segment: the transferred slots lie in shared-memory segments
// (same_host.hpp) described after the slot table, and travel in no collective.
// same_host_closed: the root ended the same-host path of this (group, root) - it lost a link -
// and this batch and every later one take the network path (every rank ends it here).
// relayed: the layout's segments are the root's; after the frame their used bytes move in
// chunks along a chain of host leaders (point to point, each forwarding what lands), and each
// leader hands its own copy to its host (relay.hpp). Bits 3-4 carry the root's options.transport (transport_flag), which
// followers check.
enum frame_flags : std::uint32_t { payload_checksums = 1, shared_segment = 2, same_host_closed = 4, relayed = 32 };

inline constexpr std::uint32_t transport_flag(transport_mode m) { return (static_cast<std::uint32_t>(m) & 3u) << 3; }
inline constexpr transport_mode transport_of(std::uint32_t flags) { return static_cast<transport_mode>((flags >> 3) & 3u); }

struct frame_header {
    std::uint32_t magic = frame_magic;
    std::uint16_t version = format_version;
    std::uint16_t status = 0;
    std::uint64_t fingerprint = 0;      // schema fingerprint of the root's batch type
    std::uint64_t body_bytes = 0;
    std::uint64_t payload_bytes = 0;    // sum of the transfer slots
    std::uint32_t slot_count = 0;
    std::uint32_t flags = 0;
    std::uint64_t body_checksum = 0;
    std::uint64_t sequence = 0;         // the root's broadcast count on this group
    std::uint32_t root = 0;
    std::uint32_t header_checksum = 0;  // over the 60 bytes before it

    std::uint32_t compute_checksum() const {
        return static_cast<std::uint32_t>(checksum64(this, offsetof(frame_header, header_checksum)));
    }
};
static_assert(sizeof(frame_header) == 64, "spbcast: the frame header is 64 bytes on the wire");
static_assert(std::is_trivially_copyable_v<frame_header>);

inline constexpr std::size_t inline_body_bytes = inline_frame_bytes - sizeof(frame_header);

// A keep-alive frame (keep_alive.hpp): the root is alive and still producing its batch.
inline bool is_keep_alive(const frame_header& h) {
    return h.magic == frame_magic && h.header_checksum == h.compute_checksum() &&
           h.status == static_cast<std::uint16_t>(frame_status::keep_alive) && h.body_bytes == 0;
}
// A root's error message is cut to this, so its error frame (an empty slot table and the
// message) fits in the first message and is read whatever the follower's limits.
inline constexpr std::size_t max_error_message_bytes = inline_body_bytes - 64;

// The last collective of every broadcast that has payload slots: the root's final status
// (a root can still fail while it gathers its buckets) and, with the checksum flag, one
// checksum per slot. Its size follows from the header alone, so a follower receives it
// whatever it found, and a root that failed mid-payload still ends the sequence the header
// announced - followers then raise the root's message at once.
struct trailer_head {
    std::uint32_t status = 0;         // frame_status
    std::uint32_t message_bytes = 0;  // of the root's message, at most trailer_message_bytes
    std::uint64_t checksum = 0;       // checksum64 of the whole trailer with this field zero
};
static_assert(sizeof(trailer_head) == 16);
inline constexpr std::size_t trailer_message_bytes = 1024;

// From version 4 a same-host broadcast ends with its frame: its payload is complete before the
// frame leaves, so the root has nothing left to report.
inline bool has_trailer(const frame_header& header) {
    return header.slot_count != 0 && (header.version < 4 || !(header.flags & shared_segment));
}

inline std::size_t trailer_bytes(std::uint32_t slot_count, std::uint32_t flags) {
    return sizeof(trailer_head) + ((flags & payload_checksums) ? 8 * std::size_t{slot_count} : 0) +
           trailer_message_bytes;
}

// The trailer's own checksum: over all its bytes with trailer_head::checksum counted as zero,
// so the root and a follower compute it the same way (on a copy: the trailer is 1 KiB).
inline std::uint64_t trailer_checksum(const void* trailer, std::size_t size) {
    std::vector<std::uint8_t> bytes(static_cast<const std::uint8_t*>(trailer),
                                    static_cast<const std::uint8_t*>(trailer) + size);
    // Every trailer is longer (trailer_bytes); the check tells GCC too, which otherwise warns
    // that the write might overflow an empty vector.
    if (bytes.size() >= sizeof(trailer_head))
        std::memset(bytes.data() + offsetof(trailer_head, checksum), 0, sizeof(std::uint64_t));
    return checksum64(bytes.data(), bytes.size());
}

}  // namespace spbcast::detail
