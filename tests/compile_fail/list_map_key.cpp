// Map keys need one canonical encoding: a list as key must be refused.
#include <spbcast/broadcast.hpp>

#include "transport.hpp"

#include <map>

struct TensorKeyed {
    std::map<std::vector<int>, int> by_list;
};

void send(TensorKeyed& value, declared_transport& group) { spbcast::broadcast(value, group); }
