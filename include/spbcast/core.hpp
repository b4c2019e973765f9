// The core layer: spbcast::broadcast of any batch type over any c10d group, with its
// customization point, schema, digest, options, errors, receive cache and the same-host path's shared memory. Nothing here names
// Gloo or training code (the CMake target spbcast::core).
#pragma once

#include "broadcast.hpp"
#include "codec.hpp"
#include "digest.hpp"
#include "error.hpp"
#include "group.hpp"
#include "options.hpp"
#include "receive_cache.hpp"
#include "schema.hpp"
#include "shared_memory.hpp"
