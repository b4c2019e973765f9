// spbcast::broadcast(value, group, options): the root's value, rebuilt bit-exactly on every
// other rank of the group.
//
// The root reflects the value (its type's schema is fixed at compile time), collects its
// tensors de-duplicated by TensorImpl and grouped by storage, and sends one metadata frame
// followed by the payload in transfer slots. Followers validate the frame against their own
// schema and limits, receive the payload straight into the storages they allocate, and rebuild
// the value. Any failure is a spbcast::error on every rank, never a hang (docs/errors.md: "Errors and
// failure behaviour"; docs/wire-format.md for the frame).
#pragma once

#include "codec.hpp"
#include "detail/orchestration/broadcast.hpp"
#include "error.hpp"
#include "group.hpp"
#include "options.hpp"
#include "receive_cache.hpp"
#include "schema.hpp"
#include "shared_memory.hpp"
