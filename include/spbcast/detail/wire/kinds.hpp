// Every kind's traits but the struct kinds', and the dispatch to a type's kind. A new kind is an
// enumerator at its priority in kind_traits.hpp, which also says which file holds which kind's
// traits, and its traits in one of the files included here - or, for a kind that needs
// reflection, in kind_records.hpp (the reflection front end, which the core does not include).
#pragma once

#include "ivalue_codec.hpp"
#include "kind_containers.hpp"
#include "kind_scalars.hpp"
#include "kind_traits.hpp"
#include "kind_tuples.hpp"
#include "kind_wrappers.hpp"

#include <cstddef>
#include <string>
#include <utility>

namespace spbcast::detail {

// Matches what nothing before it matched. Its schema is require_supported's error, so it
// contributes nothing of its own: one failure, not a cascade.
template <>
struct kind_traits<kind::unsupported> {
    template <class T>
    static constexpr bool matches = true;
    template <class T>
    static constexpr void schema(schema_builder&) {}
    template <class T>
    static constexpr std::size_t min_bytes() { return 0; }
    template <class T>
    static void encode(auto&, const T&) {}
    template <class T>
    static void decode(auto&, T&) {}
    template <class T>
    static void compare(auto&, const T&, const T&, const std::string&) {}
};

template <class T>
constexpr void append_schema(schema_builder& out) {
    require_supported<T>();
    kind_traits<kind_v<T>>::template schema<T>(out);
}

// The fewest stream bytes one value of T takes; used to reject element counts that the frame
// cannot possibly hold before reserving memory for them.
template <class T>
constexpr std::size_t min_wire_bytes() {
    return kind_traits<kind_v<T>>::template min_bytes<T>();
}

}  // namespace spbcast::detail
