// A user-written transport: forwards to a real group and counts the collectives and bytes
// that spbcast issues. It satisfies spbcast::process_group by its three members alone.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <spbcast/group.hpp>

#include <cstdint>
#include <vector>

namespace spbcast_test {

template <class Group>
struct counting_group {
    Group& inner;
    int collectives = 0;
    std::uint64_t bytes = 0;

    // spbcast knows a transport of ours by its address (spbcast::forget_group).
    ~counting_group() { spbcast::forget_group(*this); }

    int getRank() const { return inner.getRank(); }
    int getSize() const { return inner.getSize(); }
    auto broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
        ++collectives;
        bytes += static_cast<std::uint64_t>(tensors.at(0).numel());
        return inner.broadcast(tensors, opts);
    }
};

template <class Group>
counting_group(Group&) -> counting_group<Group>;

}  // namespace spbcast_test
