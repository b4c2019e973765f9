// spbcast::broadcast itself, for every kind of value but the struct kinds: <spbcast/broadcast.hpp>
// is this plus the reflection front end (Boost.PFR, Boost.Hana; detail/wire/kind_records.hpp).
// The Python extension includes this one, so that it builds with torch and a compiler alone.
#pragma once

#include "../../error.hpp"
#include "../../group.hpp"
#include "../../options.hpp"
#include "../../receive_cache.hpp"
#include "../../shared_memory.hpp"
#include "../transport/collective.hpp"
#include "../transport/group_state.hpp"
#include "../transport/handshake.hpp"
#include "receive.hpp"
#include "send.hpp"

#include <ATen/ATen.h>

#include <string>
#include <type_traits>

namespace spbcast {
namespace detail {

inline void check_options(const options& opts, int rank, int size) {
    auto bad = [&](const std::string& what) {
        throw error(errc::invalid_argument, "spbcast: rank " + std::to_string(rank) + ": " + what);
    };
    if (opts.root < 0 || opts.root >= size)
        bad("options.root = " + std::to_string(opts.root) + " is not a rank of this group of size " +
            std::to_string(size) + "; use a group rank in [0, " + std::to_string(size) + ")");
    if (opts.timeout.count() <= 0) bad("options.timeout must be positive");
    if (opts.root_wait.count() < 0) bad("options.root_wait must not be negative");
    if (opts.bucket_bytes == 0) bad("options.bucket_bytes must be positive");
}

// The same-host state of (group, root), or null: decided by the handshake, by every rank
// together, on the first broadcast that may use it - and checked by every rank against its
// options.transport. The root offers the handshake on a group it can track (or on any group when
// options.transport asks for the same-host path); a follower without a decision always looks
// for the offer, whatever its own options, so a rank whose options.transport differs takes part
// in the handshake and every rank raises the disagreement. On transport_mode::network the offer
// is for the peer watch alone (same_host_state::watch_only): the ranks learn who is on their
// host, and the decision of the path waits for a broadcast that may use it. The state is
// returned while the path is shared, whatever this call's options.transport: a network call
// still reads the followers' answers on the root and keeps the descriptor stream in step on a
// follower.
template <class Group>
std::shared_ptr<same_host_state> same_host_for(Group& g, const options& opts, group_state& gstate,
                                               std::uint64_t sequence, at::Tensor& early_frame) {
    const bool is_root = g.getRank() == opts.root;
    auto& registry = same_host_registry::instance();
    auto state = registry.find(&g, opts.root);
    const bool watched_only = state && state->watch_only;
    if (!state || watched_only) {
        // A user's own transport cannot be told from a later one at the same address (see
        // same_host_registry): the root offers the same-host path there only when asked for it.
        if (opts.transport == transport_mode::hierarchical && !point_to_point_group<Group>)
            throw error(errc::invalid_argument,
                        "spbcast: rank " + std::to_string(g.getRank()) +
                            ": options.transport = hierarchical needs a group with send and recv (a c10d "
                            "ProcessGroup or backend); use transport_mode::automatic or network with this group");
        const bool tracked = same_host_registry::tracked<Group>;
        const bool offers = opts.transport == transport_mode::shared_memory ||
                            opts.transport == transport_mode::hierarchical ||
                            (opts.transport == transport_mode::automatic && tracked) ||
                            (opts.transport == transport_mode::network && tracked && !watched_only);
        if (is_root && !offers) return nullptr;
        auto decided = same_host_handshake(g, opts, gstate, sequence, early_frame);
        if (!decided) return nullptr;  // the root did not offer: this broadcast, the network path
        state = std::move(decided);
        registry.put(&g, opts.root, state, same_host_registry::owner_of(g));
    }
    if (!state->shared && opts.transport == transport_mode::shared_memory)
        throw error(errc::invalid_argument,
                    "spbcast: rank " + std::to_string(g.getRank()) + ": broadcast #" + std::to_string(sequence) +
                        " from root " + std::to_string(opts.root) +
                        ": options.transport = shared_memory, but the same-host path cannot be used "
                        "in this group (" + state->why_not +
                        "); run every rank of the group on one host, as one user, in one network "
                        "namespace, or use transport_mode::automatic to fall back to the network");
    return state->shared ? state : nullptr;
}

}  // namespace detail

// Broadcasts `value` from the group rank options.root to every rank of `group`. On the root
// `value` is read and left unchanged; on every other rank it is replaced by an identical copy
// on the CPU. All ranks of the group must call it with the same type and options.
template <class T, class Group>
    requires process_group_like<Group>
void broadcast(T& value, Group&& group, const options& opts = {}) {
    detail::require_supported<std::remove_cv_t<T>>();
    auto& g = detail::group_of(group);
    const int rank = g.getRank();
    const int size = g.getSize();
    detail::check_options(opts, rank, size);
    if (size == 1) return;
    const auto state = detail::group_registry::instance().state_of(g);
    if (state->broken)
        throw transport_error(*state->broken,
                              "spbcast: rank " + std::to_string(rank) +
                                  ": this group is out of step since an earlier broadcast failed "
                                  "on this rank, so no collective is issued on it: " +
                                  state->broken_cause,
                              "before the frame");
    const std::uint64_t sequence = ++state->broadcasts;
    try {
        at::Tensor early_frame;  // a follower's: the root sent its frame instead of an offer
        const auto same_host = detail::same_host_for(g, opts, *state, sequence, early_frame);
        detail::collective<std::remove_reference_t<decltype(g)>> c(g, opts, *state, sequence);
        if (rank == opts.root)
            detail::send(c, value, same_host.get());
        else
            detail::receive(c, value, same_host.get(), early_frame);
    } catch (const transport_error&) {
        // The group is unusable: its same-host sockets close now, and segments still mapped by
        // other ranks are never written again.
        detail::same_host_registry::instance().drop(&g, opts.root);
        throw;
    }
}

}  // namespace spbcast
