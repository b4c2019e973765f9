// JPEG files through libjpeg-turbo's TurboJPEG API (link -lturbojpeg). The demo dataset keeps
// its images and video frames as real JPEG files so that loading a sample costs what it costs
// in a real trainer: a file read and a decode per image or frame.
#pragma once

#include <turbojpeg.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace demo {

struct DecodedImage {
    int width = 0;
    int height = 0;
    std::vector<uint8_t> rgb;  // row-major, 3 bytes per pixel
};

namespace detail {

struct TjDestroy {
    void operator()(void* handle) const noexcept { tjDestroy(handle); }
};
using TjHandle = std::unique_ptr<void, TjDestroy>;

inline TjHandle make_tj_handle(tjhandle handle, const char* kind) {
    if (handle == nullptr)
        throw std::runtime_error(std::string("cannot create a TurboJPEG ") + kind + ": " +
                                 tjGetErrorStr2(nullptr));
    return TjHandle(handle);
}

}  // namespace detail

// 4:2:0 subsampling, as cameras and web images mostly are.
inline std::vector<uint8_t> encode_jpeg(const uint8_t* rgb, int width, int height, int quality) {
    if (width <= 0 || height <= 0 || quality < 1 || quality > 100)
        throw std::invalid_argument("encode_jpeg: need a positive size and a quality in 1..100, got " +
                                    std::to_string(width) + "x" + std::to_string(height) +
                                    " quality " + std::to_string(quality));
    detail::TjHandle tj = detail::make_tj_handle(tjInitCompress(), "compressor");
    // A buffer of tjBufSize() always suffices, so TurboJPEG never reallocates memory we own.
    std::vector<uint8_t> jpeg(tjBufSize(width, height, TJSAMP_420));
    unsigned char* out = jpeg.data();
    unsigned long size = jpeg.size();
    if (tjCompress2(tj.get(), rgb, width, 0, height, TJPF_RGB, &out, &size, TJSAMP_420, quality,
                    TJFLAG_NOREALLOC) != 0)
        throw std::runtime_error("JPEG encoding of a " + std::to_string(width) + "x" +
                                 std::to_string(height) + " image failed: " +
                                 tjGetErrorStr2(tj.get()));
    jpeg.resize(size);
    return jpeg;
}

// `source` names the data in error messages (a file path, usually). Warnings such as a
// truncated file are errors here: a damaged file must not turn into a silently grey image.
inline DecodedImage decode_jpeg(std::span<const uint8_t> jpeg, std::string_view source = "JPEG data") {
    detail::TjHandle tj = detail::make_tj_handle(tjInitDecompress(), "decompressor");
    DecodedImage image;
    int subsampling = 0, colorspace = 0;
    if (tjDecompressHeader3(tj.get(), jpeg.data(), jpeg.size(), &image.width, &image.height,
                            &subsampling, &colorspace) != 0)
        throw std::runtime_error(std::string(source) + ": not a readable JPEG (" +
                                 tjGetErrorStr2(tj.get()) + ")");
    image.rgb.resize(static_cast<size_t>(image.width) * image.height * 3);
    if (tjDecompress2(tj.get(), jpeg.data(), jpeg.size(), image.rgb.data(), image.width, 0,
                      image.height, TJPF_RGB, 0) != 0)
        throw std::runtime_error(std::string(source) + ": JPEG decoding failed (" +
                                 tjGetErrorStr2(tj.get()) + ")");
    return image;
}

inline std::vector<uint8_t> read_file(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (!in) throw std::runtime_error("cannot open " + path.string() + ": " + std::strerror(errno));
    std::vector<uint8_t> bytes(static_cast<size_t>(in.tellg()));
    in.seekg(0);
    if (!in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size())))
        throw std::runtime_error("cannot read " + path.string() + ": " + std::strerror(errno));
    return bytes;
}

inline void write_file(const std::filesystem::path& path, std::span<const uint8_t> bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) throw std::runtime_error("cannot write " + path.string() + ": " + std::strerror(errno));
}

inline DecodedImage load_jpeg(const std::filesystem::path& path) {
    return decode_jpeg(read_file(path), path.string());
}

}  // namespace demo
