// The struct kinds, the reflection front end: Boost.Hana Structs (named fields) and Boost.PFR
// aggregates (positional fields), each sent as its fields in order with no count (the contract:
// kind_traits.hpp). They alone need Boost, so the core (kinds.hpp and everything a broadcast of
// standard types, tensors and c10::IValue instantiates) does not include this header: the public
// headers that reflect a user's type (schema.hpp, and through it broadcast.hpp and digest.hpp)
// do, and the Python extension, which never reflects a C++ struct, builds without Boost.
#pragma once

#include "fields.hpp"
#include "kinds.hpp"
#include "type_name.hpp"

#include <boost/hana/concept/struct.hpp>

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

namespace spbcast::detail {

// Hana Structs and aggregates differ only in how they match and in the field names a Hana
// Struct's schema shows (fields.hpp reads both).
struct record_traits {
    template <class T>
    static constexpr void schema(schema_builder& out) {
        out += type_name<T>();
        out += '{';
        for_each_field_index<T>([&](auto index) {
            constexpr std::size_t i = decltype(index)::value;
            if (i != 0) out += ',';
            if constexpr (is_hana_struct<T>) {
                out += field_name<T, i>();
                out += ':';
            }
            append_schema<field_type_t<T, i>>(out);
        });
        out += '}';
    }
    template <class T>
    static constexpr std::size_t min_bytes() {
        return []<std::size_t... I>(std::index_sequence<I...>) {
            return (std::size_t{0} + ... + min_wire_bytes<field_type_t<T, I>>());
        }(std::make_index_sequence<field_count<T>()>{});
    }
    template <class T>
    static void encode(auto& out, const T& v) {
        for_each_field_index<T>([&](auto index) {
            constexpr std::size_t i = decltype(index)::value;
            out.field(field_name<T, i>(), i, field<i>(v));
        });
    }
    template <class T>
    static void decode(auto& in, T& v) {
        for_each_field_index<T>([&](auto index) {
            constexpr std::size_t i = decltype(index)::value;
            in.field(field_name<T, i>(), i, field<i>(v));
        });
    }
    // Fields in declaration order, as a braced initializer evaluates them.
    template <class T>
    static T make(auto& in) {
        return [&]<std::size_t... I>(std::index_sequence<I...>) {
            return T{in.template make_field<field_type_t<T, I>>(field_name<T, I>(), I)...};
        }(std::make_index_sequence<field_count<T>()>{});
    }
    template <class T>
    static void compare(auto& same, const T& a, const T& b, const std::string& path) {
        for_each_field_index<T>([&](auto index) {
            constexpr std::size_t i = decltype(index)::value;
            same.check(field<i>(a), field<i>(b), path + "." + std::to_string(i));
        });
    }
};

template <>
struct kind_traits<kind::hana_struct> : record_traits {
    template <class T>
    static constexpr bool matches = is_hana_struct<T>;
};

template <>
struct kind_traits<kind::aggregate> : record_traits {
    template <class T>
    static constexpr bool matches = std::is_aggregate_v<T> && std::is_class_v<T> && !std::is_union_v<T>;
};

// The whole table, now that the struct kinds are here too.
static_assert([]<std::size_t... K>(std::index_sequence<K...>) {
    return ((sizeof(kind_traits<static_cast<kind>(K)>) != 0) && ...);
}(std::make_index_sequence<kind_count>{}), "spbcast: every kind has its kind_traits");

}  // namespace spbcast::detail
