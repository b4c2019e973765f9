// What spbcast needs from a process group: its rank, its size and a broadcast of CPU tensors.
// c10d::ProcessGroup (both LibTorch generations), c10d::Backend / ProcessGroupGloo (2.x), a
// c10::intrusive_ptr or std::shared_ptr to one of them, and a user's own transport with the
// same three members all qualify.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "detail/transport/group_state.hpp"

#include <concepts>
#include <memory>
#include <type_traits>
#include <vector>

namespace spbcast {

template <class G>
concept process_group = requires(G& group, std::vector<at::Tensor>& tensors,
                                 const c10d::BroadcastOptions& opts) {
    { group.getRank() } -> std::convertible_to<int>;
    { group.getSize() } -> std::convertible_to<int>;
    { group.broadcast(tensors, opts) };
    // The returned work handle is waited on: work->wait() or work.wait().
};

// A group argument: a group itself or anything that dereferences to one.
template <class G>
concept process_group_like = process_group<std::remove_cvref_t<G>> || requires(G& g) {
    requires process_group<std::remove_reference_t<decltype(*g)>>;
};

namespace detail {

template <class G>
decltype(auto) group_of(G& group) {
    if constexpr (process_group<G>) {
        return (group);
    } else {
        return (*group);
    }
}

}  // namespace detail

// spbcast keeps a little state per group (group_state.hpp): the broadcast count every frame is
// checked against, and whether this rank left the group out of step. c10d groups are tracked
// by a weak reference, so a new group can never inherit a dropped one's state; the weak
// reference defers the dropped group's destructor (Gloo joins its threads and closes its
// sockets there) to the next spbcast call in this process, or to the drop itself when you call
// this first. A transport of your own that is not a c10::intrusive_ptr_target is known by its
// address: call this when destroying it, so a new object at that address starts fresh.
template <class Group>
void forget_group(Group&& group) {
    detail::group_registry::instance().forget(static_cast<const void*>(&detail::group_of(group)));
}

}  // namespace spbcast
