// The motivating example (docs/broadcast.md): three local ranks of an SP group, only rank 0 has the
// collated batch; after spbcast::broadcast every rank holds the same one.
#include "profiles.hpp"

#include <spbcast/spbcast.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>

int main() {
    constexpr int sp_size = 3;
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::mutex print;
    auto rank_main = [&](int rank) {
        auto sp_group = spbcast::dist::make_gloo_group(store, rank, sp_size, std::chrono::seconds(30));

        xtuner::Batch batch;  // filled by the loader on the leader, empty elsewhere
        if (rank == 0) batch = xtuner::make_batch(xtuner::profile::qwen3_vl_image, 2, /*seed=*/1);
        spbcast::broadcast(batch, sp_group);  // afterwards every rank holds the same batch

        const auto& ctx = batch[0].seq_ctx;
        std::ostringstream out;
        out << "rank " << rank << ": " << batch.size() << " micro-batches, input_ids "
            << ctx.input_ids.sizes() << ", pixel_values " << ctx.pixel_values->sizes() << " "
            << ctx.pixel_values->scalar_type() << ", position_ids strides " << ctx.position_ids.strides()
            << ", cu_seq_lens_k is cu_seq_lens_q: " << std::boolalpha
            << ctx.cu_seq_lens_k.is_same(ctx.cu_seq_lens_q) << ", digest " << std::hex
            << spbcast::digest(batch) << "\n";
        std::lock_guard<std::mutex> lock(print);
        std::cout << out.str();
    };
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < sp_size; ++rank) ranks.emplace_back(rank_main, rank);
    for (auto& r : ranks) r.join();
}
