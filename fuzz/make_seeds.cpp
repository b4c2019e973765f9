// Writes the fuzz target's seed corpus: valid inputs (fuzz_common.hpp) recorded from real
// broadcasts of realistic batches - each xtuner profile's layout at a small pack length, with
// and without the checksum trailer - and of dynamic IValue batches, plus an error frame and a
// frame of another wire-format version.
//
//   spbcast_fuzz_seeds <output directory>
#include "support/frames.hpp"
#include "fuzz_common.hpp"
#include "profiles.hpp"
#include "support/fixtures.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

// The follower's view of one broadcast, flattened into a fuzz input; at most `payload_cap`
// payload bytes are kept (the target fills the rest with zeros).
std::vector<std::uint8_t> to_input(std::uint8_t selector, const std::vector<std::vector<std::uint8_t>>& messages,
                                   std::size_t payload_cap = 2048) {
    const auto parts = spbcast_fault::split_frame(messages);
    std::vector<std::uint8_t> out{selector};
    const auto* h = reinterpret_cast<const std::uint8_t*>(&parts.header);
    out.insert(out.end(), h, h + sizeof parts.header);
    out.insert(out.end(), parts.body.begin(), parts.body.end());
    std::size_t kept = 0;
    for (std::size_t i = spbcast_fault::frame_message_count(messages); i < messages.size() && kept < payload_cap; ++i) {
        const std::size_t n = std::min(messages[i].size(), payload_cap - kept);
        out.insert(out.end(), messages[i].begin(), messages[i].begin() + static_cast<std::ptrdiff_t>(n));
        kept += n;
    }
    return out;
}

xtuner::Batch small_batch(xtuner::profile_shape shape, int micro, std::uint64_t seed) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    xtuner::Batch batch;
    for (int m = 0; m < micro; ++m) batch.push_back(xtuner::make_item(shape, gen));
    return batch;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::cerr << "usage: spbcast_fuzz_seeds <output directory>\n";
        return 2;
    }
    const std::filesystem::path dir = argv[1];
    std::filesystem::create_directories(dir);
    int written = 0;
    auto write = [&](const std::string& name, const std::vector<std::uint8_t>& input) {
        std::ofstream(dir / name, std::ios::binary)
            .write(reinterpret_cast<const char*>(input.data()), static_cast<std::streamsize>(input.size()));
        ++written;
    };
    spbcast::options opts;
    opts.limits = spbcast_fuzz::fuzz_limits();
    opts.inplace_min_bytes = 4096;
    opts.bucket_bytes = 2048;
    const xtuner::profile_shape shapes[] = {{2048, 0, false, false},   // text
                                            {2048, 64, false, true},   // qwen3-vl image
                                            {2048, 2, true, false},    // interns1 tiles
                                            {4096, 128, false, true}}; // qwen3-vl video
    for (int s = 0; s < 4; ++s)
        for (int micro : {1, 2})
            for (bool checksum : {false, true}) {
                opts.checksum = checksum;
                const auto messages = spbcast_fault::record(small_batch(shapes[s], micro, 7 + s), opts);
                write("xtuner-" + std::to_string(s) + "-" + std::to_string(micro) + (checksum ? "-sum" : ""),
                      to_input(0, messages));
            }
    opts.checksum = false;
    for (int v = 0; v < 4; ++v) write("ivalue-" + std::to_string(v), to_input(1, spbcast_fault::record(spbcast_test::representative_dict(v), opts)));
    write("ivalue-none", to_input(1, spbcast_fault::record(c10::IValue(), opts)));
    write("xtuner-empty", to_input(0, spbcast_fault::record(xtuner::Batch{}, opts)));

    // An error frame: what a root that failed before sending sends.
    {
        spbcast_fault::capture_group root;
        xtuner::Batch bad = small_batch(shapes[0], 1, 1);
        bad[0].seq_ctx.pixel_values = at::empty({2}, at::TensorOptions().device(at::kMeta));
        try {
            spbcast::broadcast(bad, root, opts);
        } catch (const spbcast::error&) {
        }
        write("xtuner-error-frame", to_input(0, root.messages));
    }
    // Another wire-format version (the follower drains).
    {
        auto messages = spbcast_fault::record(small_batch(shapes[1], 1, 3), opts);
        auto parts = spbcast_fault::split_frame(messages);
        parts.header.version = 2;
        write("xtuner-version-2", to_input(0, spbcast_fault::join_frame(parts)));
    }
    std::cout << "spbcast_fuzz_seeds: wrote " << written << " seeds to " << dir << "\n";
    return 0;
}
