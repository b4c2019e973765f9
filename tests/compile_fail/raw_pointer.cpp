// A raw pointer field cannot be sent: spbcast must say to hold the value instead.
#include <spbcast/broadcast.hpp>

#include "transport.hpp"

struct WithPointer {
    at::Tensor ids;
    float* scale;
};

void send(WithPointer& value, declared_transport& group) { spbcast::broadcast(value, group); }
