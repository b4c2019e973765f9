// spbcast_demo's rank mode (demo_worker.cpp), and the pieces of it the launcher also needs.
#pragma once

#include "demo_options.hpp"

#include <cstdint>
#include <string>

namespace demo {

// One rank of one arm: reads the launcher environment, builds the DP x SP groups and the
// leader_loader, runs the steps, and reports (see demo_results.hpp). Returns the exit status.
int run_worker(const DemoOptions& options);

// Matmuls that take about model_ms of single-thread compute on this machine (0 for 0 ms).
int64_t calibrate_model_iters(double model_ms);

// "LibTorch 1.13", the generation this program was compiled against.
std::string torch_description();

}  // namespace demo
