// The kinds made of a fixed list of values: tuples and pairs, Boost.Hana Structs (named
// fields) and Boost.PFR aggregates (positional fields), all sent as their elements in order
// with no count (the contract: kind_traits.hpp).
#pragma once

#include "fields.hpp"
#include "kind_traits.hpp"
#include "type_name.hpp"

#include <boost/hana/concept/struct.hpp>

#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace spbcast::detail {

template <class T>
concept tuple_like = is_specialization_of<T, std::tuple> || is_specialization_of<T, std::pair>;

template <>
struct kind_traits<kind::tuple> {
    template <class T>
    static constexpr bool matches = tuple_like<T>;
    template <class T>
    static constexpr void schema(schema_builder& out) {
        out += "tuple<";
        [&]<std::size_t... I>(std::index_sequence<I...>) {
            append_schema_list<std::tuple_element_t<I, T>...>(out, ',');
        }(std::make_index_sequence<std::tuple_size_v<T>>{});
        out += '>';
    }
    template <class T>
    static constexpr std::size_t min_bytes() {
        return []<std::size_t... I>(std::index_sequence<I...>) {
            return (std::size_t{0} + ... + min_wire_bytes<std::tuple_element_t<I, T>>());
        }(std::make_index_sequence<std::tuple_size_v<T>>{});
    }
    template <class T>
    static void encode(auto& out, const T& v) {
        std::apply([&](const auto&... elements) { (out.value(elements), ...); }, v);
    }
    template <class T>
    static void decode(auto& in, T& v) {
        std::apply([&](auto&... elements) { (in.value(elements), ...); }, v);
    }
    // A braced initializer evaluates its elements left to right, the wire's order.
    template <class T>
    static T make(auto& in) {
        return [&]<std::size_t... I>(std::index_sequence<I...>) {
            return T{in.template make<std::tuple_element_t<I, T>>()...};
        }(std::make_index_sequence<std::tuple_size_v<T>>{});
    }
    template <class T>
    static void compare(auto& same, const T& a, const T& b, const std::string& path) {
        [&]<std::size_t... I>(std::index_sequence<I...>) {
            (same.check(std::get<I>(a), std::get<I>(b), path + "." + std::to_string(I)), ...);
        }(std::make_index_sequence<std::tuple_size_v<T>>{});
    }
};

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

}  // namespace spbcast::detail
