// The reflection-free core (what the Python extension builds on, without Boost) has no struct
// kinds: broadcasting a struct there must say which header brings them.
#include <spbcast/detail/orchestration/broadcast.hpp>

#include "transport.hpp"

struct Sample {
    at::Tensor ids;
    long count;
};

void send(Sample& value, declared_transport& group) { spbcast::broadcast(value, group); }
