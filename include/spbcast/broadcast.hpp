// spbcast::broadcast(value, group, options): the root's value, rebuilt bit-exactly on every
// other rank of the group.
//
// The root reflects the value (its type's schema is fixed at compile time), collects its
// tensors de-duplicated by TensorImpl and grouped by storage, and sends one metadata frame
// followed by the payload in transfer slots. Followers validate the frame against their own
// schema and limits, receive the payload straight into the storages they allocate, and rebuild
// the value. Any failure is a spbcast::error on every rank, never a hang (README: "Errors and
// failure behaviour"; docs/wire-format.md for the frame).
#pragma once

#include "codec.hpp"
#include "detail/collective.hpp"
#include "detail/group_state.hpp"
#include "detail/receive.hpp"
#include "detail/send.hpp"
#include "error.hpp"
#include "group.hpp"
#include "options.hpp"
#include "receive_cache.hpp"
#include "schema.hpp"

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
    detail::collective<std::remove_reference_t<decltype(g)>> c(g, opts, *state, ++state->broadcasts);
    if (rank == opts.root)
        detail::send(c, value);
    else
        detail::receive(c, value);
}

}  // namespace spbcast
