// Options of one broadcast. An aggregate, so callers write spbcast::broadcast(b, g, {.root = 1}).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace spbcast {

// Upper bounds a follower enforces while decoding a frame, before it allocates anything. They
// protect a follower from a corrupt or hostile frame; the root checks the same bounds before
// sending, so a batch that breaks them fails on the root with a clear message.
struct limits {
    std::size_t max_frame_bytes = std::size_t{256} << 20;     // metadata frame body
    std::size_t max_tensors = std::size_t{1} << 20;           // distinct tensors in one batch
    std::size_t max_dims = 64;                                // dimensions of one tensor
    std::uint64_t max_payload_bytes = std::uint64_t{1} << 40; // tensor bytes of one batch
    std::size_t max_string_bytes = std::size_t{64} << 20;     // one string
    std::size_t max_container_size = std::size_t{1} << 28;   // elements of one container
    std::size_t max_depth = 512;                              // nesting of dynamic IValues
};

// How the payload travels (docs/transports.md).
enum class transport_mode {
    // Shared memory when every rank of the group is on the root's host; hierarchical when the
    // group spans hosts, each host has at least two ranks and the group has send/recv; the
    // network path otherwise. Decided by every rank together, once per (group, root).
    automatic,
    network,        // always over the group's own collectives
    shared_memory,  // shared memory or a spbcast::error on every rank saying why it cannot
    // The payload crosses the network once per remote host (root to each host leader, send/recv
    // on the group) and reaches every rank of a host through shared memory. A host where shared
    // memory fails gets the payload rank by rank; a group without send/recv raises on every rank.
    hierarchical,
};

struct options {
    int root = 0;  // group rank of the sender
    // Bounds every wait of the broadcast; a dead or stuck peer becomes spbcast::transport_error.
    std::chrono::milliseconds timeout = std::chrono::minutes(5);
    // How long the first message of a broadcast may wait: a follower for the root to start it,
    // the root for its followers to take it; zero means options.timeout. A peer that is only
    // late - producing its batch, saving a checkpoint - is not a transport failure: raise this,
    // not timeout. The root's keep-alive frames come every quarter of the shorter of the two.
    std::chrono::milliseconds root_wait = std::chrono::milliseconds(0);
    // Storages smaller than this share coalesced buckets; larger ones are sent in place, with
    // no packing copy on the root and received straight into their final storage.
    std::size_t inplace_min_bytes = std::size_t{1} << 20;
    std::size_t bucket_bytes = std::size_t{16} << 20;  // capacity of one coalescing bucket
    std::size_t max_in_flight = 2;                     // payload collectives outstanding at once
    // Adds one small collective after the payload that carries a checksum per transfer slot;
    // followers verify it and raise errc::payload_corrupt on a mismatch.
    bool checksum = false;
    transport_mode transport = transport_mode::automatic;
    // The hierarchical path moves the payload from host leader to host leader in a chain, in
    // chunks of this size that each leader forwards as they land: a batch of B bytes over H
    // hosts takes about (B + (H - 2) x this) / link rate, and every wait covers one chunk.
    // The root's value is used (the frame carries it), clamped to [64 KiB, 1 GiB].
    std::size_t relay_chunk_bytes = std::size_t{4} << 20;
    spbcast::limits limits = {};

    std::chrono::milliseconds root_wait_or_timeout() const {
        return root_wait.count() > 0 ? root_wait : timeout;
    }
};

}  // namespace spbcast
