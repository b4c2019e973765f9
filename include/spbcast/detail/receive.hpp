// A follower's side of a broadcast: receive and validate the frame, receive the payload into
// its storages (receive_memory.hpp), rebuild the value. parse_frame and decode_value need no group, so
// the fuzz target drives them directly.
#pragma once

#include "../error.hpp"
#include "../options.hpp"
#include "../schema.hpp"
#include "bytes.hpp"
#include "collective.hpp"
#include "frame.hpp"
#include "same_host.hpp"
#include "tensor_plan.hpp"
#include "value_codec.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace spbcast::detail {

template <class Group>
std::pair<frame_header, std::vector<std::uint8_t>> receive_frame(collective<Group>& c) {
    at::Tensor first = at::empty({static_cast<std::int64_t>(inline_frame_bytes)}, at::kByte);
    c.run(first, "frame");
    const auto* in = first.data_ptr<std::uint8_t>();
    frame_header header;
    std::memcpy(&header, in, sizeof header);
    auto corrupt = [&](const std::string& what) {
        throw error(errc::corrupt_frame, c.where() + ": received a corrupt frame header (" + what +
                                             "); the sender is not spbcast or the transport "
                                             "corrupts data");
    };
    if (header.magic != frame_magic) corrupt("bad magic");
    if (header.header_checksum != header.compute_checksum()) corrupt("header checksum mismatch");
    // An error frame is always inline (send.hpp cuts the message) and is read whatever the
    // limits, so a root's error reaches every follower as the root's error.
    const bool inline_error = header.status == static_cast<std::uint16_t>(frame_status::error) &&
                              header.body_bytes <= inline_body_bytes;
    if (header.body_bytes > c.opts().limits.max_frame_bytes && !inline_error)
        throw error(errc::limit_exceeded,
                    c.where() + ": the frame body of " + std::to_string(header.body_bytes) +
                        " bytes exceeds limits.max_frame_bytes = " +
                        std::to_string(c.opts().limits.max_frame_bytes) +
                        "; use the same limits on every rank");
    std::vector<std::uint8_t> body(header.body_bytes);
    const std::size_t inline_part = std::min<std::size_t>(body.size(), inline_body_bytes);
    if (inline_part != 0) std::memcpy(body.data(), in + sizeof header, inline_part);
    if (body.size() > inline_part) {
        at::Tensor rest = at::empty({static_cast<std::int64_t>(body.size() - inline_part)}, at::kByte);
        c.run(rest, "frame body");
        std::memcpy(body.data() + inline_part, rest.data_ptr<std::uint8_t>(), rest.numel());
    }
    if (checksum64(body.data(), body.size()) != header.body_checksum)
        corrupt("body checksum mismatch");
    return {header, std::move(body)};
}

// Receives and discards the announced payload, so the group stays in step when this rank
// cannot use the batch (schema or version mismatch).
//
// The scratch buffer draining needs: as large as the largest slot, or nothing when the slots
// together exceed limits.max_payload_bytes (then this rank refuses to receive and the root
// times out). Checked slot by slot: announced sizes are untrusted and their sum could wrap.
inline std::optional<std::uint64_t> drain_scratch_bytes(const std::vector<slot_meta>& slots,
                                                        const limits& lim) {
    std::uint64_t total = 0, largest = 0;
    for (const auto& s : slots) {
        if (s.bytes > lim.max_payload_bytes - total) return std::nullopt;
        total += s.bytes;
        largest = std::max(largest, s.bytes);
    }
    return largest;
}

template <class Group>
void drain_payload(collective<Group>& c, const frame_header& header,
                   const std::vector<slot_meta>& slots) {
    if (!(header.flags & shared_segment)) {  // a shared segment has no payload collectives
        const auto largest = drain_scratch_bytes(slots, c.opts().limits);
        if (!largest) return;  // refuse to allocate; the root times out
        at::Tensor scratch = at::empty({static_cast<std::int64_t>(*largest)}, at::kByte);
        for (std::size_t i = 0; i < slots.size(); ++i)
            c.run(scratch.narrow(0, 0, static_cast<std::int64_t>(slots[i].bytes)),
                  "draining payload slot " + std::to_string(i));
    }
    if (header.flags & checksum_trailer)
        c.run(at::empty({static_cast<std::int64_t>(8 * slots.size())}, at::kByte), "draining checksums");
}

inline std::string schema_difference(std::string_view local, std::string_view root) {
    std::size_t i = 0;
    while (i < local.size() && i < root.size() && local[i] == root[i]) ++i;
    const std::size_t from = i > 40 ? i - 40 : 0;
    return "first difference at character " + std::to_string(i) + ": this rank has '..." +
           std::string(local.substr(from, 80)) + "', the root has '..." +
           std::string(root.substr(from, 80)) + "'";
}

// A frame body that passed validation, and what the follower does with it next.
struct parsed_frame {
    receive_plan plan;
    std::size_t values_offset = 0, values_size = 0;
    // Where the payload lies when it came in a shared segment.
    std::optional<segment_layout> segment;
    // Set when this rank cannot use the batch (schema or version mismatch): the payload is
    // drained first, then this is thrown.
    std::exception_ptr mismatch;
};

// Validates a frame body against this rank's type and limits; no collectives, no payload, so
// the fuzz target drives it directly. Throws spbcast::error for anything invalid.
template <class T>
parsed_frame parse_frame(const frame_header& header, const std::vector<std::uint8_t>& body,
                         const limits& lim, const std::string& where, int root) {
    byte_reader in(body.data(), body.size(), where + ": corrupt frame");
    if (header.status == static_cast<std::uint16_t>(frame_status::error)) {
        read_slots(in);
        // Bounded by the frame it came in (accepted whatever limits.max_frame_bytes).
        const std::string root_message = in.get_string(body.size());
        throw remote_error(where + ": the root (rank " + std::to_string(root) +
                               ") failed and sent no batch: " + root_message,
                           root, root_message);
    }
    if (header.status != static_cast<std::uint16_t>(frame_status::ok))
        in.fail("unknown frame status " + std::to_string(header.status));
    parsed_frame frame;
    frame.plan.read_slot_table(in);
    if (frame.plan.slots().size() != header.slot_count) in.fail("slot count differs from the header");
    if (header.flags & shared_segment) frame.segment = segment_layout::read(in, frame.plan.slots());
    if (header.version != format_version) {
        frame.mismatch = std::make_exception_ptr(error(
            errc::version_mismatch,
            where + ": the root sent wire format version " + std::to_string(header.version) +
                ", this rank speaks version " + std::to_string(format_version) +
                "; build every rank with the same spbcast release"));
        return frame;
    }
    const std::string root_schema = in.get_string(lim.max_frame_bytes);
    if (header.fingerprint != fingerprint_of<T> || root_schema != schema_of<T>) {
        frame.mismatch = std::make_exception_ptr(schema_error(
            where + ": this rank's batch type differs from the root's; build every rank from the "
                    "same batch types.\n  this rank: " +
                std::string(schema_of<T>) + "\n  the root:  " + root_schema + "\n  " +
                schema_difference(schema_of<T>, root_schema),
            std::string(schema_of<T>), root_schema));
        return frame;
    }
    frame.values_size = in.get_count(lim.max_frame_bytes, 1, "value stream size");
    frame.values_offset = in.offset();
    in.get_bytes(frame.values_size);
    frame.plan.read_tensor_tables(in, lim);
    if (in.remaining() != 0) in.fail("trailing bytes after the tables");
    return frame;
}

// Rebuilds the value once the payload is in the plan's storages.
template <class T>
T decode_value(const parsed_frame& frame, const std::vector<std::uint8_t>& body, const limits& lim,
               const std::string& where) {
    static_assert(std::is_default_constructible_v<T> && std::is_move_assignable_v<T>,
                  "spbcast: the broadcast type must be default-constructible and "
                  "move-assignable (followers build a fresh value and move it in)");
    try {
        const std::vector<at::Tensor> tensors = frame.plan.build_tensors();
        byte_reader values(body.data() + frame.values_offset, frame.values_size, where + ": corrupt frame");
        T result{};
        decoder dec(values, tensors, lim);
        dec.value(result);
        if (values.remaining() != 0) values.fail("trailing bytes after the value");
        return result;
    } catch (const spbcast::error&) {
        throw;
    } catch (const std::exception& e) {
        // Validation admits only what a root sends; anything LibTorch or a codec still rejects
        // is reported as what it is, a frame this rank cannot use.
        throw error(errc::corrupt_frame, where + ": the frame could not be rebuilt: " + exception_text(e));
    }
}

template <class T, class Group>
void receive_unchecked(collective<Group>& c, T& value, same_host_state* same_host) {
    const options& opts = c.opts();
    auto [header, body] = receive_frame(c);
    // The root handed the segment over before the frame; take it off the socket first, so the
    // socket stays in step whatever this rank does with the batch.
    std::optional<segment_delivery> delivery;
    if (header.flags & shared_segment) delivery = take_segment(c, same_host);
    parsed_frame frame = parse_frame<T>(header, body, opts.limits, c.where(), opts.root);
    if (frame.mismatch) {
        delivery.reset();
        drain_payload(c, header, frame.plan.slots());
        std::rethrow_exception(frame.mismatch);
    }

    receive_plan& plan = frame.plan;
    const auto& slots = plan.slots();
    std::vector<std::uint64_t> checksums(slots.size());
    if (frame.segment) {
        std::vector<at::Tensor> slot_data;
        try {
            slot_data = map_segment(c, *delivery, *frame.segment, slots, header.sequence);
        } catch (const spbcast::error&) {
            delivery.reset();
            drain_payload(c, header, slots);  // the checksum trailer, if announced
            throw;
        }
        delivery.reset();
        if (opts.checksum)
            for (std::uint32_t i = 0; i < slots.size(); ++i)
                checksums[i] = checksum64(slot_data[i].data_ptr(), slot_data[i].numel());
        plan.adopt_slots(std::move(slot_data));
    } else {
        plan.allocate();
    }
    for (std::uint32_t i = 0; i < slots.size() && !frame.segment; ++i) {
        at::Tensor buffer = plan.slot_receive_tensor(i);
        c.launch(buffer, "payload slot " + std::to_string(i + 1) + "/" + std::to_string(slots.size()),
                 [&plan, &checksums, &opts, buffer, i] {
                     if (opts.checksum) checksums[i] = checksum64(buffer.data_ptr(), buffer.numel());
                     plan.unpack_slot(i);
                 });
    }
    at::Tensor trailer;
    if (header.flags & checksum_trailer) {
        trailer = at::empty({static_cast<std::int64_t>(8 * slots.size())}, at::kByte);
        c.launch(trailer, "checksums");
    }
    c.wait_all();
    if (trailer.defined() && opts.checksum) {
        const auto* expected = static_cast<const std::uint64_t*>(trailer.data_ptr());
        for (std::size_t i = 0; i < slots.size(); ++i)
            if (checksums[i] != expected[i])
                throw error(errc::payload_corrupt,
                            c.where() + ": payload slot " + std::to_string(i + 1) + " of " +
                                std::to_string(slots[i].bytes) +
                                " bytes arrived corrupted (checksum mismatch); the transport "
                                "damaged data - check the network and retry");
    }
    value = decode_value<T>(frame, body, opts.limits, c.where());
}

// decode_value's net covers rebuilding the value; this one also covers unpacking the payload
// (ATen's copy_ into gathered views) and draining (at::empty), so nothing from ATen or c10 ever
// leaves a follower as anything but spbcast::error.
template <class T, class Group>
void receive(collective<Group>& c, T& value, same_host_state* same_host = nullptr) {
    try {
        receive_unchecked(c, value, same_host);
    } catch (const spbcast::error&) {
        throw;
    } catch (const std::bad_alloc&) {
        throw;
    } catch (const std::exception& e) {
        throw error(errc::corrupt_frame, c.where() + ": cannot use the root's frame (" + exception_text(e) +
                                             "); the root runs an incompatible spbcast or the "
                                             "frame was damaged");
    }
}

}  // namespace spbcast::detail
