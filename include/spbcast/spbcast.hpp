// Everything spbcast offers: the core (core.hpp) and the training layer on top of it - the SP
// leader-only loader, the RNG mirror, the torch::data adapter and the Gloo/launcher helpers
// (the CMake target spbcast::spbcast). Include only what you use if compile time matters.
#pragma once

#include "core.hpp"
#include "dist.hpp"
#include "loader.hpp"
#include "prefetch_channel.hpp"
#include "rng_mirror.hpp"
#include "torch_data.hpp"
