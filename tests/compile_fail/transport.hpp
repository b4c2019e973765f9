// A transport declaration good enough to instantiate spbcast::broadcast; these files are only
// compiled, never linked.
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <vector>

struct declared_transport {
    int getRank() const;
    int getSize() const;
    void broadcast(std::vector<at::Tensor>&, const c10d::BroadcastOptions&);
};
