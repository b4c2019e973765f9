// The tables a frame carries about a batch's tensors, the same for the root that writes them
// (send_plan.hpp) and the follower that reads them back (receive_plan.hpp): per tensor its
// dtype, flags, storage, offset, sizes and strides; per storage its byte span and where in
// which transfer slot its bytes travel; per slot its mode and size (docs/wire-format.md).
#pragma once

#include "bytes.hpp"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace spbcast::detail {

inline constexpr std::uint32_t no_slot = std::numeric_limits<std::uint32_t>::max();
inline constexpr std::uint32_t undefined_tensor = std::numeric_limits<std::uint32_t>::max();
inline constexpr std::uint64_t storage_alignment = 16;  // the widest element (complex128)
inline constexpr std::uint64_t bucket_alignment = 64;

enum tensor_flags : std::uint8_t { requires_grad_flag = 1, conj_flag = 2, neg_flag = 4 };

struct tensor_meta {
    c10::ScalarType dtype;
    std::uint8_t flags = 0;
    std::uint32_t storage = 0;
    std::int64_t offset = 0;  // in elements, relative to the storage's lo
    std::vector<std::int64_t> sizes, strides;
};

struct storage_meta {
    std::uint64_t nbytes = 0;      // hi - lo: what the follower allocates
    bool gather = false;           // wire carries each view's elements instead of the span
    std::uint32_t slot = no_slot;
    std::uint64_t slot_offset = 0;
    std::uint64_t wire_bytes = 0;
    std::vector<std::uint32_t> tensors;  // referencing tensors, in table order (not sent)
    bool copied_out = false;  // follower: copied out of its bucket on arrival (not sent)
};

// Where a transfer slot travels. A batch's small buckets ride in the frame body itself (up to
// frame_payload_max_bytes together): a small batch then costs one or two collectives, with
// nothing after the header that could fail.
enum class slot_mode : std::uint8_t { bucket = 0, in_place = 1, in_frame = 2 };
inline constexpr std::uint64_t frame_payload_max_bytes = std::uint64_t{1} << 20;

struct slot_meta {
    bool in_place = false;
    std::uint64_t bytes = 0;
    std::vector<std::uint32_t> storages;  // in storage order (not sent)
    bool in_frame = false;                // its bytes follow the tables in the frame body
    std::size_t frame_offset = 0;         // follower: where in the body (not sent)

    slot_mode mode() const { return in_place ? slot_mode::in_place : in_frame ? slot_mode::in_frame : slot_mode::bucket; }
};

// Slots that travel as collectives of their own, in slot order.
inline std::uint32_t transferred_slot_count(const std::vector<slot_meta>& slots) {
    return static_cast<std::uint32_t>(std::count_if(slots.begin(), slots.end(), [](const slot_meta& s) { return !s.in_frame; }));
}

// Sizes with every stride-0 dimension narrowed to one element: what a view of an expanded
// tensor really holds. Used for gathering, so an expand costs its source, not its expansion.
inline std::vector<std::int64_t> distinct_sizes(const tensor_meta& t) {
    std::vector<std::int64_t> sizes = t.sizes;
    for (std::size_t d = 0; d < sizes.size(); ++d)
        if (t.strides[d] == 0 && sizes[d] > 1) sizes[d] = 1;
    return sizes;
}

inline std::int64_t numel_of(const std::vector<std::int64_t>& sizes) {
    std::int64_t n = 1;
    for (auto s : sizes) n *= s;
    return n;
}

inline void write_slots(byte_writer& out, const std::vector<slot_meta>& slots) {
    out.put<std::uint32_t>(static_cast<std::uint32_t>(slots.size()));
    for (const slot_meta& s : slots) {
        out.put<std::uint8_t>(static_cast<std::uint8_t>(s.mode()));
        out.put<std::uint64_t>(s.bytes);
    }
}

inline std::vector<slot_meta> read_slots(byte_reader& in) {
    const auto count = in.get<std::uint32_t>();
    if (count > in.remaining() / 9) in.fail("slot count " + std::to_string(count) + " exceeds the frame");
    std::vector<slot_meta> slots(count);
    for (slot_meta& s : slots) {
        const auto mode = in.get<std::uint8_t>();
        if (mode > static_cast<std::uint8_t>(slot_mode::in_frame)) in.fail("unknown slot mode " + std::to_string(mode));
        s.in_place = mode == static_cast<std::uint8_t>(slot_mode::in_place);
        s.in_frame = mode == static_cast<std::uint8_t>(slot_mode::in_frame);
        s.bytes = in.get<std::uint64_t>();
    }
    return slots;
}

// Visits the views of a gathered storage in wire order: f(view, its distinct sizes, its offset
// in the slot). Views without elements take no bytes and are skipped.
template <class F>
void for_each_gathered_view(const storage_meta& storage, const std::vector<tensor_meta>& tensors, F&& f) {
    std::uint64_t offset = storage.slot_offset;
    for (std::uint32_t t : storage.tensors) {
        const tensor_meta& meta = tensors[t];
        auto sizes = distinct_sizes(meta);
        const auto bytes = static_cast<std::uint64_t>(numel_of(sizes)) * c10::elementSize(meta.dtype);
        if (bytes == 0) continue;
        f(meta, std::move(sizes), offset);
        offset += bytes;
    }
}

}  // namespace spbcast::detail
