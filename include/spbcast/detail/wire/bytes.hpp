// Little-endian byte writer and a bounds-checked reader for the metadata frame, and the
// payload checksum.
#pragma once

#include "../../error.hpp"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace spbcast::detail {

static_assert(std::endian::native == std::endian::little,
              "spbcast: the wire format is little-endian and tensor payloads travel as raw "
              "bytes; big-endian hosts are not supported");

class byte_writer {
public:
    template <class T>
        requires std::is_trivially_copyable_v<T>
    void put(const T& value) {
        const auto offset = bytes_.size();
        bytes_.resize(offset + sizeof(T));
        std::memcpy(bytes_.data() + offset, &value, sizeof(T));
    }
    void put_bytes(const void* data, std::size_t size) {
        const auto offset = bytes_.size();
        bytes_.resize(offset + size);
        if (size != 0) std::memcpy(bytes_.data() + offset, data, size);
    }
    void put_string(std::string_view text) {
        put<std::uint64_t>(text.size());
        put_bytes(text.data(), text.size());
    }
    std::size_t size() const { return bytes_.size(); }
    std::vector<std::uint8_t>& bytes() { return bytes_; }

private:
    std::vector<std::uint8_t> bytes_;
};

// Reads a frame that arrived from another process. Every read is checked against the end, and
// every length against the caller's limit, before anything is allocated: a corrupt or hostile
// frame raises spbcast::error(errc::corrupt_frame), it never reads out of bounds.
class byte_reader {
public:
    byte_reader(const std::uint8_t* data, std::size_t size, std::string what)
        : data_(data), size_(size), what_(std::move(what)) {}

    template <class T>
        requires std::is_trivially_copyable_v<T>
    T get() {
        require(sizeof(T));
        T value;
        std::memcpy(&value, data_ + offset_, sizeof(T));
        offset_ += sizeof(T);
        return value;
    }
    const std::uint8_t* get_bytes(std::size_t size) {
        require(size);
        const std::uint8_t* at = data_ + offset_;
        offset_ += size;
        return at;
    }
    // A count read from the frame, checked against a limit and against the bytes left (each
    // element needs at least min_element_bytes), so it can be used to reserve memory.
    std::uint64_t get_count(std::uint64_t limit, std::size_t min_element_bytes,
                            const char* what) {
        const auto count = get<std::uint64_t>();
        if (count > limit)
            fail(std::string(what) + " of " + std::to_string(count) + " exceeds the limit of " +
                 std::to_string(limit));
        if (min_element_bytes != 0 && count > remaining() / min_element_bytes)
            fail(std::string(what) + " of " + std::to_string(count) +
                 " is larger than the frame can hold");
        return count;
    }
    std::string get_string(std::uint64_t limit) {
        const auto size = get_count(limit, 1, "string length");
        const auto* at = get_bytes(static_cast<std::size_t>(size));
        return std::string(reinterpret_cast<const char*>(at), static_cast<std::size_t>(size));
    }
    std::size_t remaining() const { return size_ - offset_; }
    std::size_t offset() const { return offset_; }
    [[noreturn]] void fail(const std::string& message) const {
        throw error(errc::corrupt_frame, what_ + ": " + message + " (at byte " +
                                             std::to_string(offset_) + ")");
    }
    // A well-formed frame beyond this rank's limits: not corrupt, so the context loses that word.
    [[noreturn]] void fail_limit(const std::string& message) const {
        const auto corrupt = what_.rfind(": corrupt");
        throw error(errc::limit_exceeded,
                    (corrupt == std::string::npos ? what_ : what_.substr(0, corrupt)) + ": " + message);
    }

private:
    void require(std::size_t size) const {
        if (size > remaining())
            fail("truncated: needs " + std::to_string(size) + " more bytes, " +
                 std::to_string(remaining()) + " left");
    }
    const std::uint8_t* data_;
    std::size_t size_;
    std::size_t offset_ = 0;
    std::string what_;
};

// A fast 64-bit checksum over bytes (four independent multiply-rotate lanes, so it runs at
// memory speed). It detects transfer corruption; it is not a cryptographic hash.
inline std::uint64_t checksum64(const void* data, std::size_t size,
                                std::uint64_t seed = 0x9e3779b97f4a7c15ull) {
    constexpr std::uint64_t prime1 = 0x9e3779b185ebca87ull, prime2 = 0xc2b2ae3d27d4eb4full;
    const auto* bytes = static_cast<const std::uint8_t*>(data);
    auto round = [](std::uint64_t acc, std::uint64_t lane) {
        return std::rotl(acc + lane * prime2, 31) * prime1;
    };
    std::uint64_t lanes[4] = {seed + prime1 + prime2, seed + prime2, seed, seed - prime1};
    std::size_t offset = 0;
    for (; offset + 32 <= size; offset += 32) {
        for (int i = 0; i < 4; ++i) {
            std::uint64_t lane;
            std::memcpy(&lane, bytes + offset + 8 * i, 8);
            lanes[i] = round(lanes[i], lane);
        }
    }
    std::uint64_t hash = std::rotl(lanes[0], 1) + std::rotl(lanes[1], 7) +
                         std::rotl(lanes[2], 12) + std::rotl(lanes[3], 18) + size;
    for (; offset < size; ++offset) hash = std::rotl(hash ^ (bytes[offset] * prime1), 11) * prime2;
    hash ^= hash >> 33;
    hash *= prime2;
    hash ^= hash >> 29;
    return hash;
}

}  // namespace spbcast::detail
