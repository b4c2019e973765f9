// What a follower makes of a frame it holds, with no group and no payload: the body validated
// against this rank's type and limits (parse_frame), and the value rebuilt once the payload is in
// the plan's storages (decode_value). Needing no collective, they are what the fuzz target
// drives directly; receive.hpp runs them inside a broadcast.
#pragma once

#include "../../error.hpp"
#include "../../options.hpp"
#include "../wire/schema_text.hpp"
#include "../base/exception_text.hpp"
#include "../transport/same_host.hpp"
#include "../wire/bytes.hpp"
#include "../wire/frame.hpp"
#include "../wire/receive_plan.hpp"
#include "../wire/value_codec.hpp"
#include "../wire/wire_tables.hpp"

#include <ATen/ATen.h>

#include <cstddef>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace spbcast::detail {

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
    // Where the transferred slots lie when they came in a shared segment.
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
    if (transferred_slot_count(frame.plan.slots()) != header.slot_count) in.fail("slot count differs from the header");
    if (header.version != format_version) {
        frame.mismatch = std::make_exception_ptr(error(
            errc::version_mismatch,
            where + ": the root sent wire format version " + std::to_string(header.version) +
                ", this rank speaks version " + std::to_string(format_version) +
                "; build every rank with the same spbcast release"));
        return frame;
    }
    // Another version's segment layout may differ: read only once the version is known.
    if (header.flags & shared_segment)
        frame.segment = segment_layout::read(in, frame.plan.slots(), header.flags & payload_checksums);
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
    static_assert(std::is_move_assignable_v<T>,
                  "spbcast: the broadcast type must be move-assignable (followers build a fresh "
                  "value and move it into the caller's)");
    try {
        const std::vector<at::Tensor> tensors = frame.plan.build_tensors();
        byte_reader values(body.data() + frame.values_offset, frame.values_size, where + ": corrupt frame");
        decoder dec(values, tensors, lim);
        T result = dec.make<T>();
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

}  // namespace spbcast::detail
