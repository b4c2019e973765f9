// The root's side of a broadcast: encode, plan, send the frame, the payload slots and the
// status trailer.
#pragma once

#include "../../error.hpp"
#include "../../options.hpp"
#include "../wire/bytes.hpp"
#include "../transport/collective.hpp"
#include "../wire/frame.hpp"
#include "../transport/relay.hpp"
#include "../transport/same_host.hpp"
#include "../wire/schema_text.hpp"
#include "../wire/send_plan.hpp"
#include "../wire/value_codec.hpp"

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
    header.flags |= transport_flag(c.opts().transport);
    header.sequence = c.sequence();
    header.header_checksum = header.compute_checksum();
    at::Tensor first = at::zeros({static_cast<std::int64_t>(inline_frame_bytes)}, at::kByte);
    auto* out = first.data_ptr<std::uint8_t>();
    std::memcpy(out, &header, sizeof header);
    const std::size_t inline_part = std::min(body.size(), inline_body_bytes);
    if (inline_part != 0) std::memcpy(out + sizeof header, body.data(), inline_part);  // a keep-alive has no body
    // The first message waits for followers that may still be busy elsewhere (a checkpoint, an
    // evaluation) as long as a follower waits for the root: root_wait. What follows is bounded
    // by options.timeout, message by message.
    c.launch(first, "frame", {}, c.opts().root_wait_or_timeout());
    if (body.size() > inline_part) {
        at::Tensor rest = at::empty({static_cast<std::int64_t>(body.size() - inline_part)}, at::kByte);
        std::memcpy(rest.data_ptr<std::uint8_t>(), body.data() + inline_part, body.size() - inline_part);
        c.launch(rest, "frame body");
    }
}

template <class Group>
void send_payload(collective<Group>& c, const send_plan& plan, const frame_header& header);

// `same_host`: the (group, root)'s same-host path, when it has one. Its followers' answers are
// read at every broadcast; unless options.transport is network, the transferred slots go into
// shared segments before the frame is sent, and the frame is the whole broadcast - but for the
// relay to the leaders of other hosts that follows it when the group spans hosts. A link lost
// since the last broadcast ends the path for every rank: this frame says so (same_host_closed)
// and this batch and all later ones take the network path.
template <class T, class Group>
void send(collective<Group>& c, const T& value, same_host_state* same_host = nullptr) {
    const options& opts = c.opts();
    send_plan plan;
    byte_writer body;
    byte_writer values;
    encoder enc(values, plan, opts.limits);
    std::optional<placed_payload> placed;
    std::uint32_t path_flags = 0;
    try {
        enc.value(value);
        plan.finish(opts);
        if (same_host) {
            same_host->collect_releases();
            if (same_host->lost.empty() && opts.transport != transport_mode::network) {
                plan.keep_frame_within(same_host_frame_bytes);
                placed = place_payload(*same_host, plan, c.sequence(), opts);
            }
            if (!same_host->lost.empty()) {
                path_flags = same_host_closed;
                same_host->end_path(c.where() + ": " + same_host->lost);
            }
        }
        plan.write_slot_table(body);
        if (placed) placed->layout.write(body);
        body.put_string(schema_of<T>);
        body.put<std::uint64_t>(values.size());
        body.put_bytes(values.bytes().data(), values.size());
        plan.write_tensor_tables(body);
        plan.write_frame_payload(body);
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
        header.flags = (placed ? shared_segment : 0) | path_flags;
        header.fingerprint = fingerprint_of<T>;
        send_frame(c, header, error_body.bytes());
        c.wait_all();
        throw error(own ? own->code() : errc::unsupported_value, message);
    }

    frame_header header;
    header.fingerprint = fingerprint_of<T>;
    header.payload_bytes = plan.payload_bytes();
    header.slot_count = transferred_slot_count(plan.slots());
    const bool relays = placed && same_host->relays();
    header.flags = (opts.checksum ? payload_checksums : 0) | (placed ? shared_segment : 0) | (relays ? relayed : 0) |
                   path_flags;
    send_frame(c, header, body.bytes());
    if (relays) {
        try {
            relay_to_hosts(c, *same_host, placed->layout, placed->pieces, c.sequence());
        } catch (...) {
            // The backend may still read the batch's segment: it is never reused or unmapped.
            if (placed->held.id) shm_pool::instance().abandon(*std::exchange(placed->held.id, std::nullopt));
            throw;
        }
    }
    send_payload(c, plan, header);
}

// Sends every announced slot and the status trailer. Packing a bucket can still fail here (an
// allocation, a copy); the remaining slots then go out as zeros and the trailer carries the
// error, so followers finish the sequence the header announced and raise the root's message at
// once, and the group stays in step.
template <class Group>
void send_payload(collective<Group>& c, const send_plan& plan, const frame_header& header) {
    const auto& slots = plan.slots();
    if (!has_trailer(header)) {
        c.wait_all();
        return;
    }
    const bool with_checksums = header.flags & payload_checksums;
    std::vector<std::uint64_t> checksums;
    std::string failure;
    errc failure_code = errc::unsupported_value;
    at::Tensor zeros;  // stands in for the slots after a failure
    std::uint32_t sent = 0;
    for (std::uint32_t i = 0; i < slots.size(); ++i) {
        if (slots[i].in_frame) continue;
        const std::string phase = "payload slot " + std::to_string(++sent) + "/" + std::to_string(header.slot_count);
        at::Tensor slot;
        if (failure.empty()) {
            try {
                slot = plan.slot_tensor(i);
            } catch (const std::exception& e) {
                failure = "packing " + phase + " failed: " + exception_text(e);
                if (const auto* own = dynamic_cast<const spbcast::error*>(&e)) failure_code = own->code();
            }
        }
        if (!failure.empty()) {
            const auto bytes = static_cast<std::int64_t>(slots[i].bytes);
            try {
                if (!zeros.defined() || zeros.numel() < bytes) zeros = at::zeros({bytes}, at::kByte);
            } catch (const std::exception& e) {
                c.break_group(errc::transport,
                              c.where() + ": " + failure + ", and the rest of the announced payload "
                                  "cannot be sent either (" + exception_text(e) +
                                  "); the group is out of step - restart the job",
                              phase);
            }
            slot = zeros.narrow(0, 0, bytes);
        }
        if (with_checksums) checksums.push_back(checksum64(slot.data_ptr(), slot.numel()));
        c.launch(std::move(slot), phase);
    }
    at::Tensor trailer = at::zeros({static_cast<std::int64_t>(trailer_bytes(header.slot_count, header.flags))}, at::kByte);
    auto* out = trailer.data_ptr<std::uint8_t>();
    trailer_head head;
    const std::string message = c.where() + ": " + failure;
    if (!failure.empty()) {
        head.status = static_cast<std::uint32_t>(frame_status::error);
        head.message_bytes = static_cast<std::uint32_t>(std::min(message.size(), trailer_message_bytes));
    }
    std::memcpy(out, &head, sizeof head);
    out += sizeof head;
    if (with_checksums) {
        std::memcpy(out, checksums.data(), 8 * checksums.size());
        out += 8 * checksums.size();
    }
    std::memcpy(out, message.data(), head.message_bytes);
    head.checksum = trailer_checksum(trailer.data_ptr(), static_cast<std::size_t>(trailer.numel()));
    std::memcpy(trailer.data_ptr(), &head, sizeof head);
    c.launch(trailer, "status trailer");
    c.wait_all();
    if (!failure.empty()) throw error(failure_code, message);
}

}  // namespace spbcast::detail
