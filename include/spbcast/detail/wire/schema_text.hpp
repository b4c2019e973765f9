// The schema text of a type and its fingerprint (spbcast::schema_of, spbcast::fingerprint_of):
// computed at compile time by the kinds' traits. Without the struct kinds: the public
// <spbcast/schema.hpp> adds those; the orchestration includes this, so that a broadcast of
// standard types, tensors and c10::IValue (the Python extension) compiles without Boost.
#pragma once

#include "kinds.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace spbcast {
namespace detail {

template <class T>
constexpr schema_builder schema_string() {
    schema_builder out;
    append_schema<T>(out);
    return out;
}

// constexpr allocations cannot outlive constant evaluation, so the text is copied into a
// fixed array once per type.
template <class T>
struct schema_text {
    static constexpr std::size_t size = schema_string<T>().size();
    static constexpr std::array<char, size + 1> chars = [] {
        std::array<char, size + 1> a{};
        const schema_builder s = schema_string<T>();
        for (std::size_t i = 0; i < size; ++i) a[i] = s[i];
        return a;
    }();
};

constexpr std::uint64_t fnv1a64(std::string_view text) {
    std::uint64_t hash = 0xcbf29ce484222325ull;
    for (char c : text) {
        hash ^= static_cast<unsigned char>(c);
        hash *= 0x100000001b3ull;
    }
    return hash;
}

}  // namespace detail

template <class T>
inline constexpr std::string_view schema_of{detail::schema_text<T>::chars.data(),
                                            detail::schema_text<T>::size};

template <class T>
inline constexpr std::uint64_t fingerprint_of = detail::fnv1a64(schema_of<T>);

}  // namespace spbcast
