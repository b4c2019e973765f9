// The common shape of a broadcast test: every rank makes the expected value with the same
// deterministic factory; the root broadcasts its copy, followers start from `start` and must
// end up identical to the expected value; the root's value must be left unchanged.
#pragma once

#include "identical.hpp"
#include "ranks.hpp"

#include <spbcast/broadcast.hpp>

namespace spbcast_test {

template <class T, class Make>
void roundtrip(int world, int root, Make make, T start = T{}, spbcast::options opts = {}) {
    opts.root = root;
    run_ranks(world, [&](int rank, auto& group) {
        T value = rank == root ? make() : start;
        spbcast::broadcast(value, group, opts);
        const T expected = make();
        require_identical(expected, value);
    });
}

}  // namespace spbcast_test
