// Each build says which LibTorch it compiled and linked against, and fails if the two differ
// (two LibTorch generations can sit on one machine; a wrong include or rpath would otherwise go
// unnoticed).
#include <spbcast/detail/base/version.hpp>

#include <c10/core/CPUAllocator.h>
#include <doctest/doctest.h>
#include <dlfcn.h>

#include <filesystem>
#include <iostream>
#include <string>

TEST_CASE("the LibTorch compiled against is the LibTorch linked against") {
    const std::string compiled =
        std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
    Dl_info info{};
    REQUIRE(dladdr(reinterpret_cast<void*>(&c10::GetCPUAllocator), &info) != 0);
    const auto linked = std::filesystem::canonical(info.dli_fname).parent_path();
    const auto expected_dir = std::filesystem::canonical(SPBCAST_EXPECTED_TORCH_LIBDIR);
    std::cout << "spbcast tests: compiled against LibTorch " << compiled << " (CMake found "
              << SPBCAST_EXPECTED_TORCH_VERSION << "), linked against " << info.dli_fname << "\n";
    CHECK(std::string(SPBCAST_EXPECTED_TORCH_VERSION).rfind(compiled + ".", 0) == 0);
    CHECK(linked == expected_dir);
}
