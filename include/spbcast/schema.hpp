// The schema of a batch type: a canonical, readable description computed at compile time from
// the type alone, and its 64-bit fingerprint. The root sends both; a follower built with a
// different type sees the two schemas side by side in its error.
//
//   spbcast::schema_of<Batch>       -> "list<xtuner::Item{seq_ctx:xtuner::SequenceContext{...}}>"
//   spbcast::fingerprint_of<Batch>  -> FNV-1a 64 of the schema text
//
// Each kind writes its own part of the text (detail/wire/kinds.hpp lists where).
#pragma once

#include "detail/wire/kinds.hpp"

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
