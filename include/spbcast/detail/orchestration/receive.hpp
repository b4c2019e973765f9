// A follower's side of a broadcast: receive and validate the frame, receive the payload into
// its storages (receive_cache.hpp), rebuild the value. Validating the body and rebuilding the
// value need no group (decode.hpp); this header runs them in the fixed sequence of collectives.
#pragma once

#include "../../error.hpp"
#include "../../options.hpp"
#include "../wire/bytes.hpp"
#include "../transport/collective.hpp"
#include "../transport/receive_cache.hpp"
#include "../wire/frame.hpp"
#include "../transport/handshake.hpp"
#include "../transport/relay.hpp"
#include "../transport/same_host.hpp"
#include "../wire/schema_text.hpp"
#include "decode.hpp"
#include "../wire/receive_plan.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>
#include <new>
#include <optional>
#include <string>
#include <vector>

namespace spbcast::detail {

// Receives the frame. Whatever leaves this rank unable to know the rest of the announced
// sequence (a damaged header or body, a body it cannot even allocate) breaks the group: the
// next collective could mismatch the root's.
// `early`: the first message, when the same-host handshake already received it.
template <class Group>
std::pair<frame_header, std::vector<std::uint8_t>> receive_frame(collective<Group>& c, at::Tensor early = {}) {
    auto corrupt = [&](const std::string& what, const std::string& phase) {
        c.break_group(errc::corrupt_frame,
                      c.where() + ": received a corrupt frame (" + what +
                          "); the sender is not spbcast or the transport corrupts data, and this "
                          "rank cannot tell what follows - restart the job",
                      phase);
    };
    at::Tensor first = early.defined() ? early : at::empty({static_cast<std::int64_t>(inline_frame_bytes)}, at::kByte);
    const auto* in = first.data_ptr<std::uint8_t>();
    frame_header header;
    do {  // keep-alive frames: the root is alive and still producing its batch
        if (early.defined())
            early = at::Tensor();
        else
            c.run(first, "frame", c.opts().root_wait_or_timeout());
        std::memcpy(&header, in, sizeof header);
        if (header.magic != frame_magic) corrupt("bad magic", "frame");
        if (header.header_checksum != header.compute_checksum()) corrupt("header checksum mismatch", "frame");
    } while (is_keep_alive(header));
    const std::size_t inline_part = std::min<std::uint64_t>(header.body_bytes, inline_body_bytes);
    const limits& lim = c.opts().limits;
    if (header.body_bytes > std::max<std::uint64_t>(lim.max_frame_bytes, lim.max_payload_bytes))
        c.break_group(errc::limit_exceeded,
                      c.where() + ": the announced frame body of " + std::to_string(header.body_bytes) +
                          " bytes exceeds limits.max_frame_bytes and limits.max_payload_bytes, so "
                          "this rank cannot even drain it; the group is out of step - use the same "
                          "limits on every rank",
                      "frame body");
    std::vector<std::uint8_t> body;
    try {
        // Received even beyond limits.max_frame_bytes (checked once the payload is drained,
        // like every limit): the body holds the slot table, without which nothing can be drained.
        at::Tensor rest;
        if (header.body_bytes > inline_part) {
            rest = at::empty({static_cast<std::int64_t>(header.body_bytes - inline_part)}, at::kByte);
        }
        if (rest.defined()) c.run(rest, "frame body");
        body.resize(static_cast<std::size_t>(header.body_bytes));
        if (inline_part != 0) std::memcpy(body.data(), in + sizeof header, inline_part);
        if (rest.defined()) std::memcpy(body.data() + inline_part, rest.data_ptr<std::uint8_t>(), rest.numel());
    } catch (const spbcast::error&) {
        throw;
    } catch (const std::exception& e) {
        c.break_group(errc::limit_exceeded,
                      c.where() + ": cannot allocate the announced frame body of " +
                          std::to_string(header.body_bytes) + " bytes (" + exception_text(e) +
                          "); the group is out of step - restart the job",
                      "frame body");
    }
    if (checksum64(body.data(), body.size()) != header.body_checksum)
        corrupt("body checksum mismatch", "frame body");
    return {header, std::move(body)};
}

// The slot table leads the body in every version, so this rank can always learn the announced
// payload messages; a table it cannot read breaks the group.
template <class Group>
std::vector<slot_meta> announced_slots(collective<Group>& c, const frame_header& header,
                                       const std::vector<std::uint8_t>& body) {
    try {
        byte_reader in(body.data(), body.size(), c.where() + ": corrupt frame");
        auto slots = read_slots(in);
        if (transferred_slot_count(slots) != header.slot_count) in.fail("slot count differs from the header");
        return slots;
    } catch (const spbcast::error& e) {
        c.break_group(errc::corrupt_frame,
                      std::string(e.what()) + "; this rank cannot tell what follows - restart the job",
                      "frame");
    }
}

// The size of the message that ends a broadcast after its payload slots (0: none). Version 1
// ended with an optional checksum message; later versions keep this rule for the versions
// they know, so a follower can drain a frame it cannot use.
inline std::uint64_t announced_trailer_bytes(const frame_header& header) {
    if (header.version == 1) return (header.flags & payload_checksums) ? 8 * std::uint64_t{header.slot_count} : 0;
    return has_trailer(header) ? trailer_bytes(header.slot_count, header.flags) : 0;
}

// The scratch buffer draining needs: as large as the largest slot (one buffer serves every
// slot). A message this rank does not keep is drained up to limits.max_payload_bytes, the most
// a frame may make a follower allocate; beyond that it cannot be drained.
inline std::uint64_t drain_scratch_bytes(const std::vector<slot_meta>& slots) {
    std::uint64_t largest = 0;
    for (const auto& s : slots)
        if (!s.in_frame) largest = std::max(largest, s.bytes);
    return largest;
}

// Receives and discards the announced payload and trailer, so the group stays in step when
// this rank cannot use the batch. Returns the trailer (empty if none was announced).
template <class Group>
std::vector<std::uint8_t> drain_payload(collective<Group>& c, const frame_header& header,
                                        const std::vector<slot_meta>& slots) {
    const std::uint64_t trailer_size = announced_trailer_bytes(header);
    at::Tensor scratch, trailer;
    try {
        const std::uint64_t largest = (header.flags & shared_segment) ? 0 : drain_scratch_bytes(slots);
        if (largest > c.opts().limits.max_payload_bytes)
            throw std::length_error("a slot of " + std::to_string(largest) +
                                    " bytes exceeds limits.max_payload_bytes = " +
                                    std::to_string(c.opts().limits.max_payload_bytes));
        scratch = at::empty({static_cast<std::int64_t>(largest)}, at::kByte);
        trailer = at::empty({static_cast<std::int64_t>(trailer_size)}, at::kByte);
    } catch (const std::exception& e) {
        c.break_group(errc::limit_exceeded,
                      c.where() + ": cannot drain the announced payload (" + exception_text(e) +
                          "); the group is out of step - restart the job",
                      "draining");
    }
    const bool in_segment = header.flags & shared_segment;  // no payload collective then
    for (std::size_t i = 0; i < slots.size() && !in_segment; ++i)
        if (!slots[i].in_frame)
            c.launch(scratch.narrow(0, 0, static_cast<std::int64_t>(slots[i].bytes)),
                     "draining payload slot " + std::to_string(i + 1));
    if (trailer_size != 0) c.launch(trailer, "draining the status trailer");
    c.wait_all();
    std::vector<std::uint8_t> out(trailer_size);
    if (trailer_size != 0) std::memcpy(out.data(), trailer.data_ptr(), trailer_size);
    return out;
}

// The root's final word on a broadcast, from its trailer: throws the root's error, or returns
// the payload checksums it sent (empty without the checksum flag).
inline std::vector<std::uint64_t> read_trailer(const frame_header& header,
                                               const std::vector<std::uint8_t>& trailer,
                                               const std::string& where, int root) {
    if (header.version == 1 || trailer.empty()) {
        std::vector<std::uint64_t> sums(trailer.size() / 8);
        if (!sums.empty()) std::memcpy(sums.data(), trailer.data(), 8 * sums.size());
        return sums;
    }
    byte_reader in(trailer.data(), trailer.size(), where + ": corrupt status trailer");
    trailer_head head;
    head.status = in.get<std::uint32_t>();
    head.message_bytes = in.get<std::uint32_t>();
    head.checksum = in.get<std::uint64_t>();
    if (trailer_checksum(trailer.data(), trailer.size()) != head.checksum)
        throw error(errc::payload_corrupt, where + ": the status trailer arrived corrupted (checksum "
                                                   "mismatch); the transport damaged data - check the "
                                                   "network and retry");
    std::vector<std::uint64_t> sums;
    if (header.flags & payload_checksums)
        for (std::uint32_t i = 0; i < header.slot_count; ++i) sums.push_back(in.get<std::uint64_t>());
    if (head.status == static_cast<std::uint32_t>(frame_status::ok)) return sums;
    if (head.status != static_cast<std::uint32_t>(frame_status::error) || head.message_bytes > trailer_message_bytes)
        in.fail("unknown status " + std::to_string(head.status));
    const auto* text = in.get_bytes(head.message_bytes);
    const std::string root_message(reinterpret_cast<const char*>(text), head.message_bytes);
    throw remote_error(where + ": the root (rank " + std::to_string(root) +
                           ") failed while sending the batch: " + root_message,
                       root, root_message);
}

// What must agree between this rank and the root beyond the batch type: the broadcast count
// on this group, the root, the checksum option and this rank's frame limit. Throws the reason
// this rank refuses the batch.
template <class Group>
void check_agreement(collective<Group>& c, const frame_header& header) {
    const options& opts = c.opts();
    auto refuse = [&](errc code, const std::string& what) {
        throw error(code, c.where() + ": " + what);
    };
    if (header.sequence != c.sequence()) {
        const std::uint64_t ours = c.sequence();
        c.adopt_sequence(header.sequence);  // the next broadcast is in step again
        // A rank's first broadcast on a group object (a new process after a restart, a new
        // wrapper around the same communicator) has no count of its own to hold against the
        // root's: it takes the root's.
        if (ours == 1) return check_agreement(c, header);
        refuse(errc::out_of_step,
               "the root sent its broadcast #" + std::to_string(header.sequence) +
                   " on this group while this is this rank's #" + std::to_string(ours) +
                   "; a rank skipped or added a spbcast::broadcast call - every rank must make "
                   "the same calls on a group in the same order");
    }
    if (header.root != static_cast<std::uint32_t>(opts.root))
        refuse(errc::out_of_step, "the frame came from rank " + std::to_string(header.root) +
                                      " but this rank called with options.root = " +
                                      std::to_string(opts.root) + "; pass the same root on every rank");
    if (header.status == static_cast<std::uint16_t>(frame_status::ok) && transport_of(header.flags) != opts.transport)
        refuse(errc::invalid_argument, std::string("options.transport is ") + transport_name(transport_of(header.flags)) +
                                           " on the root and " + transport_name(opts.transport) +
                                           " on this rank; pass the same options on every rank");
    const bool root_checksums = header.flags & payload_checksums;
    if (header.status == static_cast<std::uint16_t>(frame_status::ok) && root_checksums != opts.checksum)
        refuse(errc::out_of_step, std::string("options.checksum is ") + (root_checksums ? "true" : "false") +
                                      " on the root and " + (opts.checksum ? "true" : "false") +
                                      " on this rank; pass the same options on every rank");
    const bool inline_error = header.status == static_cast<std::uint16_t>(frame_status::error) &&
                              header.body_bytes <= inline_body_bytes;
    if (header.body_bytes > opts.limits.max_frame_bytes && !inline_error)
        refuse(errc::limit_exceeded, "the frame body of " + std::to_string(header.body_bytes) +
                                         " bytes exceeds limits.max_frame_bytes = " +
                                         std::to_string(opts.limits.max_frame_bytes) +
                                         "; use the same limits on every rank");
}

// Anything a follower meets while it cannot use a batch, as a spbcast::error: c10 and
// allocation failures included, so nothing else ever leaves a follower.
inline std::exception_ptr as_spbcast_error(std::exception_ptr failure, const std::string& where) {
    try {
        std::rethrow_exception(failure);
    } catch (const spbcast::error&) {
        return failure;
    } catch (const std::bad_alloc&) {
        return std::make_exception_ptr(error(errc::limit_exceeded,
                                             where + ": out of memory while allocating the batch; "
                                                     "the payload was drained and the group is usable"));
    } catch (const std::exception& e) {
        return std::make_exception_ptr(error(errc::corrupt_frame, where + ": cannot use the root's frame (" +
                                                                      exception_text(e) + ")"));
    } catch (...) {
        return std::make_exception_ptr(error(errc::corrupt_frame, where + ": cannot use the root's frame"));
    }
}

// Follower, before any payload: takes the same-host message that answers this frame off the
// socket first (so the descriptor stream stays in step whatever this rank does with the batch;
// what is not mapped is released), checks the agreement and the frame, and places the
// payload's storages. On a host other than the root's the segment comes from the host leader,
// for relayed frames only; the host leader itself brings its slots in `segment_slots` (or why
// it has none in `relay_failure`). Returns why this rank refuses the batch, or null.
template <class T, class Group>
std::exception_ptr accept_frame(collective<Group>& c, const frame_header& header, const std::vector<std::uint8_t>& body,
                                const std::vector<slot_meta>& slots, same_host_state* same_host,
                                std::optional<parsed_frame>& frame, std::vector<at::Tensor>& segment_slots,
                                std::exception_ptr relay_failure) {
    try {
        const bool remote = same_host && same_host->relays() && same_host->leader != c.opts().root;
        const bool leads_remote = remote && same_host->leader == c.rank();
        std::optional<segment_delivery> delivery;
        if ((header.flags & shared_segment) && !leads_remote && (!remote || (header.flags & relayed)))
            delivery = take_segments(c, same_host, header.sequence);
        std::exception_ptr disagreement;
        try {
            check_agreement(c, header);
        } catch (const spbcast::error&) {
            disagreement = std::current_exception();
        }
        std::exception_ptr unusable;
        try {
            frame.emplace(parse_frame<T>(header, body, c.opts().limits, c.where(), c.opts().root));
        } catch (const spbcast::error&) {
            unusable = std::current_exception();
        }
        // Another version or batch type explains everything else that differs, and options
        // that differ explain a frame this rank's limits cannot read.
        if (frame && frame->mismatch) return frame->mismatch;
        if (disagreement) return disagreement;
        if (unusable) return unusable;
        if (relay_failure) return relay_failure;
        if (frame->segment && remote && !leads_remote) {
            segment_layout local = relay_plan(*frame->segment).local;
            if (delivery->message.count == 0)
                throw error(errc::limit_exceeded,
                            c.where() + ": the host leader (rank " + std::to_string(same_host->leader) +
                                ") could not place the relayed batch in shared memory; this batch is lost on "
                                "this host, the group stays usable");
            local.segments[0].id = delivery->message.ids[0];
            local.segments[0].capacity = delivery->message.capacity;
            if (local.segments[0].used > local.segments[0].capacity)
                throw error(errc::corrupt_frame, c.where() + ": the host leader's segment is smaller than the batch");
            segment_slots = map_segments(c, *delivery, local, slots);
        } else if (frame->segment && !leads_remote) {
            segment_slots = map_segments(c, *delivery, *frame->segment, slots);
        }
        if (frame->segment) {
            frame->plan.adopt_slots(segment_slots, receive_cache::instance());
        } else {
            frame->plan.allocate(receive_cache::instance());
        }
        return nullptr;
    } catch (...) {
        return as_spbcast_error(std::current_exception(), c.where());
    }
}

// A follower's broadcast. After the frame it issues exactly the announced messages whatever it
// finds: a batch it refuses (another type or version, its limits, an unknown dtype, no memory,
// a throwing callback) is drained first and refused afterwards, so the next broadcast works.
template <class T, class Group>
void receive(collective<Group>& c, T& value, same_host_state* same_host = nullptr,
             at::Tensor early_frame = {}) {
    const options& opts = c.opts();
    // Answers the socket had no room for, then that this rank starts this broadcast: the root may
    // wait for it before it places the batch, to reuse what this rank let go of.
    if (same_host && same_host->link) same_host->link->arrive(c.sequence());
    if (same_host && !same_host->links.empty()) {
        // A host leader reads its followers' answers at every broadcast, as the root does. A
        // follower that is gone fails the group's next collective; until then this host keeps
        // relaying to the others, as the root's frames announce.
        same_host->collect_releases();
        same_host->lost.clear();
    }
    auto [header, body] = receive_frame(c, std::move(early_frame));
    const std::vector<slot_meta> slots = announced_slots(c, header, body);
    if ((header.flags & same_host_closed) && same_host)
        same_host->end_path(c.where() + ": the root (rank " + std::to_string(header.root) +
                            ") ended the same-host path: it lost its link to a follower");

    // A host leader relays the batch to its host before anything else: its host's ranks need it
    // whatever this rank does with it.
    std::vector<at::Tensor> segment_slots;
    std::exception_ptr relay_failure;
    if (header.flags & relayed) {
        if (!same_host || !same_host->relays())
            c.break_group(errc::out_of_step,
                          c.where() + ": the root relays this batch between hosts, but this rank left the "
                                      "hierarchical path; the group is out of step - restart the job",
                          "relay");
        if (same_host->leader == c.rank())
            segment_slots = relay_in(c, *same_host, header, body, slots, relay_failure);
    }
    // A follower on the root's host holds its batch before the root relays it on: it waits for
    // the root's relay reports before this broadcast ends, whatever it does with the batch.
    const bool beside_relaying_root = (header.flags & relayed) && same_host && same_host->leader == c.opts().root &&
                                      c.rank() != c.opts().root;
    std::optional<parsed_frame> frame;
    if (const auto refusal = accept_frame<T>(c, header, body, slots, same_host, frame, segment_slots, relay_failure)) {
        const std::vector<std::uint8_t> trailer = drain_payload(c, header, slots);
        if (beside_relaying_root) await_root_relay(c, *same_host, header.sequence);
        read_trailer(header, trailer, c.where(), static_cast<int>(header.root));  // the root's error first
        std::rethrow_exception(refusal);
    }

    receive_plan& plan = frame->plan;
    const std::uint64_t trailer_size = announced_trailer_bytes(header);
    at::Tensor trailer = at::empty({static_cast<std::int64_t>(trailer_size)}, at::kByte);
    std::vector<std::uint64_t> checksums(header.slot_count);
    std::uint32_t received = 0;
    if (frame->segment)  // in place already; only checksums to compute
        for (std::uint32_t i = 0, k = 0; i < slots.size(); ++i)
            if (!slots[i].in_frame && opts.checksum)
                checksums[k++] = checksum64(segment_slots[i].data_ptr(), static_cast<std::size_t>(segment_slots[i].numel()));
    segment_slots.clear();
    for (std::uint32_t i = 0; i < slots.size() && !frame->segment; ++i) {
        if (slots[i].in_frame) continue;
        at::Tensor buffer = plan.slot_receive_tensor(i);
        const std::uint32_t k = received++;
        c.launch(buffer, "payload slot " + std::to_string(k + 1) + "/" + std::to_string(header.slot_count),
                 [&plan, &checksums, &opts, buffer, i, k] {
                     if (opts.checksum) checksums[k] = checksum64(buffer.data_ptr(), buffer.numel());
                     plan.unpack_slot(i);
                 });
    }
    if (trailer_size != 0) c.launch(trailer, "status trailer");
    c.wait_all();
    if (beside_relaying_root) await_root_relay(c, *same_host, header.sequence);
    const auto* trailer_data = static_cast<const std::uint8_t*>(trailer.data_ptr());
    const auto trailer_checksums = read_trailer(header, std::vector<std::uint8_t>(trailer_data, trailer_data + trailer_size),
                                                c.where(), static_cast<int>(header.root));
    const auto& expected = frame->segment ? frame->segment->checksums : trailer_checksums;
    if (c.callback_failure()) std::rethrow_exception(as_spbcast_error(c.callback_failure(), c.where()));
    if (opts.checksum)
        for (std::size_t k = 0; k < checksums.size(); ++k)
            if (checksums[k] != expected.at(k))
                throw error(errc::payload_corrupt,
                            c.where() + ": payload slot " + std::to_string(k + 1) +
                                " arrived corrupted (checksum mismatch); the transport damaged "
                                "data - check the network and retry");
    try {
        // Slots that came in the frame (covered by its checksum), now that the sequence is done.
        for (std::uint32_t i = 0; i < slots.size(); ++i) {
            if (!slots[i].in_frame) continue;
            const slot_meta& slot = plan.slots()[i];
            at::Tensor buffer = plan.slot_receive_tensor(i);
            if (slot.bytes != 0) std::memcpy(buffer.data_ptr(), body.data() + slot.frame_offset, slot.bytes);
            plan.unpack_slot(i);
        }
        value = decode_value<T>(*frame, body, opts.limits, c.where());
    } catch (...) {
        std::rethrow_exception(as_spbcast_error(std::current_exception(), c.where()));
    }
}

}  // namespace spbcast::detail
