// A class with private state is neither an aggregate nor a Hana struct: spbcast must refuse
// it at compile time and say how to teach it (spbcast::codec).
#include <spbcast/broadcast.hpp>

#include "transport.hpp"

class Opaque {
    int hidden = 0;
};

void send(Opaque& value, declared_transport& group) { spbcast::broadcast(value, group); }
