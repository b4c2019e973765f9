// Everything spbcast offers. Include only what you use if compile time matters.
#pragma once

#include "broadcast.hpp"
#include "digest.hpp"
#include "dist.hpp"
