// A codec that can send but not rebuild: spbcast must ask for from_wire, not fail deep inside.
#include <spbcast/broadcast.hpp>

#include "transport.hpp"

class Handle {
public:
    int64_t id() const { return id_; }

private:
    int64_t id_ = 0;
};

template <>
struct spbcast::codec<Handle> {
    static int64_t to_wire(const Handle& h) { return h.id(); }
};

void send(Handle& value, declared_transport& group) { spbcast::broadcast(value, group); }
