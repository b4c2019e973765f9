// The root's side of a broadcast: encode, plan, send the frame, then the payload slots.
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
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace spbcast::detail {

// Sends the fixed-size first message (header + start of the body), then the rest of the body.
template <class Group>
void send_frame(collective<Group>& c, frame_header header, const std::vector<std::uint8_t>& body) {
    header.body_bytes = body.size();
    header.body_checksum = checksum64(body.data(), body.size());
    header.root = static_cast<std::uint32_t>(c.opts().root);
    header.sequence = c.sequence();
    header.header_checksum = header.compute_checksum();
    at::Tensor first = at::zeros({static_cast<std::int64_t>(inline_frame_bytes)}, at::kByte);
    auto* out = first.data_ptr<std::uint8_t>();
    std::memcpy(out, &header, sizeof header);
    const std::size_t inline_part = std::min(body.size(), inline_body_bytes);
    std::memcpy(out + sizeof header, body.data(), inline_part);
    c.launch(first, "frame");
    if (body.size() > inline_part) {
        at::Tensor rest = at::empty({static_cast<std::int64_t>(body.size() - inline_part)}, at::kByte);
        std::memcpy(rest.data_ptr<std::uint8_t>(), body.data() + inline_part, body.size() - inline_part);
        c.launch(rest, "frame body");
    }
}

// `same_host`: the (group, root) chose the same-host path; the payload then goes into a shared
// segment before the frame is sent, and no payload collective follows.
template <class T, class Group>
void send(collective<Group>& c, const T& value, same_host_state* same_host = nullptr) {
    const options& opts = c.opts();
    send_plan plan;
    byte_writer body;
    byte_writer values;
    encoder enc(values, plan, opts.limits);
    std::optional<segment_layout> layout;
    try {
        enc.value(value);
        plan.finish(opts);
        if (same_host) layout = place_payload(*same_host, plan, c.sequence(), opts.checksum);
        plan.write_slot_table(body);
        if (layout) layout->write(body);
        body.put_string(schema_of<T>);
        body.put<std::uint64_t>(values.size());
        body.put_bytes(values.bytes().data(), values.size());
        plan.write_tensor_tables(body);
        if (body.size() > opts.limits.max_frame_bytes)
            throw error(errc::limit_exceeded,
                        "the metadata frame of " + std::to_string(body.size()) +
                            " bytes exceeds limits.max_frame_bytes = " +
                            std::to_string(opts.limits.max_frame_bytes) +
                            "; raise it on every rank or send fewer, larger values");
    } catch (const std::exception& e) {
        // Tell the followers before raising here, so none of them waits for a batch that
        // will never come. The group stays usable. A user exception (a codec, a custom type)
        // gets the field it was thrown from.
        const auto* own = dynamic_cast<const spbcast::error*>(&e);
        const std::string message =
            c.where() + ": " + (own ? std::string(e.what()) : "cannot send " + enc.path().str() + ": " + exception_text(e));
        byte_writer error_body;
        write_slots(error_body, {});
        // The error frame always fits in the first, fixed-size message, whatever the limits.
        error_body.put_string(std::string_view(message).substr(0, max_error_message_bytes));
        frame_header header;
        header.status = static_cast<std::uint16_t>(frame_status::error);
        // Followers were handed the segment already: they take it off their socket and let go.
        header.flags = layout ? shared_segment : 0;
        header.fingerprint = fingerprint_of<T>;
        send_frame(c, header, error_body.bytes());
        c.wait_all();
        throw error(own ? own->code() : errc::unsupported_value, message);
    }

    frame_header header;
    header.fingerprint = fingerprint_of<T>;
    header.payload_bytes = plan.payload_bytes();
    header.slot_count = static_cast<std::uint32_t>(plan.slots().size());
    header.flags = (opts.checksum ? checksum_trailer : 0) | (layout ? shared_segment : 0);
    send_frame(c, header, body.bytes());

    std::vector<std::uint64_t> checksums;
    if (layout) {
        checksums = layout->checksums;
    } else {
        for (std::uint32_t i = 0; i < plan.slots().size(); ++i) {
            at::Tensor slot = plan.slot_tensor(i);
            if (opts.checksum) checksums.push_back(checksum64(slot.data_ptr(), slot.numel()));
            c.launch(std::move(slot), "payload slot " + std::to_string(i + 1) + "/" +
                                          std::to_string(plan.slots().size()));
        }
    }
    if (opts.checksum) {
        at::Tensor trailer = at::empty({static_cast<std::int64_t>(8 * checksums.size())}, at::kByte);
        if (!checksums.empty()) std::memcpy(trailer.data_ptr(), checksums.data(), 8 * checksums.size());
        c.launch(trailer, "checksums");
    }
    c.wait_all();
}

}  // namespace spbcast::detail
