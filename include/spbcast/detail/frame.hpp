// The fixed 64-byte frame header (see docs/wire-format.md). The first collective of every
// broadcast carries it together with the start of the body in a fixed-size message, so a
// small batch needs one metadata collective and followers need no size in advance.
#pragma once

#include "bytes.hpp"

#include <cstdint>
#include <cstring>

namespace spbcast::detail {

inline constexpr std::uint32_t frame_magic = 0x43425053;  // "SPBC" in little-endian bytes
inline constexpr std::uint16_t format_version = 1;
inline constexpr std::size_t inline_frame_bytes = 8192;  // header + first body bytes

enum class frame_status : std::uint16_t { ok = 0, error = 1 };
// shared_segment: the payload lies in a shared-memory segment (same_host.hpp) described after
// the slot table, and no payload collective follows.
enum frame_flags : std::uint32_t { checksum_trailer = 1, shared_segment = 2 };

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
// A root's error message is cut to this, so its error frame (an empty slot table and the
// message) fits in the first message and is read whatever the follower's limits.
inline constexpr std::size_t max_error_message_bytes = inline_body_bytes - 64;

}  // namespace spbcast::detail
