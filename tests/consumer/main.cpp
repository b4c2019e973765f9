// Two ranks as threads broadcast a small batch through the installed spbcast.
#include <spbcast/broadcast.hpp>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <iostream>
#include <thread>

struct Batch {
    at::Tensor ids;
    std::vector<std::string> sources;
};

int main() {
    auto store = c10::make_intrusive<c10d::HashStore>();
    bool ok = true;
    auto rank_main = [&](int rank) {
        auto options = c10d::ProcessGroupGloo::Options::create();
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, 2, options);
        Batch batch;
        if (rank == 0) batch = {at::arange(6).view({2, 3}), {"a.jpg", "b.mp4"}};
        spbcast::broadcast(batch, group);
        if (rank == 1) ok = batch.sources.size() == 2 && batch.ids.sum().item<int64_t>() == 15;
    };
    std::thread follower(rank_main, 1);
    rank_main(0);
    follower.join();
    std::cout << "consumer: " << (ok ? "ok" : "MISMATCH") << "\n";
    return ok ? 0 : 1;
}
