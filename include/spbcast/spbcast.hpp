// Everything spbcast offers. Include only what you use if compile time matters.
#pragma once

#include "broadcast.hpp"
#include "digest.hpp"
#include "dist.hpp"
#include "loader.hpp"
#include "receive_cache.hpp"
#include "rng_mirror.hpp"
#include "torch_data.hpp"
