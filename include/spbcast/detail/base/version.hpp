// Which LibTorch generation we compile against, for the few places where they differ.
#pragma once

#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#else
#include <torch/version.h>
#endif

#define SPBCAST_TORCH_AT_LEAST(major, minor) \
    (TORCH_VERSION_MAJOR > (major) ||        \
     (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
