// Sorts every C++ type into the one kind spbcast handles it as. Order matters: a codec beats
// reflection, a std::array is a sequence before it is tuple-like, and an aggregate is the last
// resort. reflect<T> below is computed once per type.
#pragma once

#include "../codec.hpp"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <boost/hana/accessors.hpp>
#include <boost/hana/concept/struct.hpp>
#include <boost/pfr/core.hpp>
#include <boost/pfr/tuple_size.hpp>

#include <array>
#include <concepts>
#include <optional>
#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

namespace spbcast::detail {

enum class kind {
    custom,      // spbcast::codec<T>
    tensor,      // at::Tensor
    ivalue,      // c10::IValue
    boolean,
    integer,
    floating,
    enumeration,
    string,      // std::string
    optional,    // std::optional, and c10::optional where it is a type of its own
    variant,     // std::variant
    array,       // std::array
    sequence,    // std::vector, std::deque, std::list
    set,         // std::set, std::unordered_set
    map,         // std::map, std::unordered_map
    tuple,       // std::pair, std::tuple
    hana_struct, // a Boost.Hana Struct: named fields
    aggregate,   // a Boost.PFR-reflectable aggregate: positional fields
    unsupported,
};

template <class T, template <class...> class Template>
inline constexpr bool is_specialization_of = false;
template <template <class...> class Template, class... Args>
inline constexpr bool is_specialization_of<Template<Args...>, Template> = true;

template <class T>
inline constexpr bool is_std_array = false;
template <class T, std::size_t N>
inline constexpr bool is_std_array<std::array<T, N>> = true;

// Matches std::optional and a distinct c10::optional (LibTorch 1.x) alike, without naming the
// latter (in LibTorch 2.x it is an alias of std::optional).
template <class T>
concept optional_like = requires(T& value) {
    typename T::value_type;
    { value.has_value() } -> std::same_as<bool>;
    value.reset();
    *value;
    value.emplace();
} && std::is_constructible_v<T, std::nullopt_t> || is_specialization_of<T, std::optional>;

template <class T>
concept map_like = requires(T& map) {
    typename T::key_type;
    typename T::mapped_type;
    map.emplace(std::declval<typename T::key_type>(), std::declval<typename T::mapped_type>());
    map.size();
    map.clear();
};

template <class T>
concept set_like = !map_like<T> && requires(T& set) {
    typename T::key_type;
    typename T::value_type;
    set.insert(std::declval<typename T::value_type>());
    set.size();
    set.clear();
};

template <class T>
concept sequence_like = !std::same_as<T, std::string> && requires(T& seq) {
    typename T::value_type;
    seq.push_back(std::declval<typename T::value_type>());
    seq.size();
    seq.clear();
    seq.begin();
    seq.end();
};

template <class T>
concept tuple_like = is_specialization_of<T, std::tuple> || is_specialization_of<T, std::pair>;

template <class T>
constexpr kind kind_of() {
    if constexpr (has_codec<T>) return kind::custom;
    else if constexpr (std::is_same_v<T, at::Tensor>) return kind::tensor;
    else if constexpr (std::is_same_v<T, c10::IValue>) return kind::ivalue;
    else if constexpr (std::is_same_v<T, bool>) return kind::boolean;
    else if constexpr (std::is_integral_v<T>) return kind::integer;
    else if constexpr (std::is_floating_point_v<T>) return kind::floating;
    else if constexpr (std::is_enum_v<T>) return kind::enumeration;
    else if constexpr (std::is_same_v<T, std::string>) return kind::string;
    else if constexpr (optional_like<T>) return kind::optional;
    else if constexpr (is_specialization_of<T, std::variant>) return kind::variant;
    else if constexpr (is_std_array<T>) return kind::array;
    else if constexpr (map_like<T>) return kind::map;
    else if constexpr (set_like<T>) return kind::set;
    else if constexpr (sequence_like<T>) return kind::sequence;
    else if constexpr (tuple_like<T>) return kind::tuple;
    else if constexpr (boost::hana::Struct<T>::value) return kind::hana_struct;
    else if constexpr (std::is_aggregate_v<T> && std::is_class_v<T> && !std::is_union_v<T>)
        return kind::aggregate;
    else return kind::unsupported;
}

template <class T>
inline constexpr kind kind_v = kind_of<std::remove_cv_t<T>>();

// A map key must be a string or a scalar, so that it has one canonical encoding.
template <class K>
inline constexpr bool is_key_type = kind_v<K> == kind::string || kind_v<K> == kind::integer ||
                                    kind_v<K> == kind::boolean || kind_v<K> == kind::enumeration;

// Fails once, at the outermost unsupported type; the compiler's instantiation note names it.
template <class T>
constexpr void require_supported() {
    static_assert(!std::is_pointer_v<T>,
                  "spbcast: raw pointers cannot be broadcast; hold the value itself, or "
                  "specialize spbcast::codec<T> for the owning type.");
    static_assert(std::is_pointer_v<T> || kind_v<T> != kind::unsupported,
                  "spbcast: this type cannot be broadcast (its name is in the 'T = ...' of the "
                  "instantiation note). Make it an aggregate, adapt it with "
                  "BOOST_HANA_DEFINE_STRUCT / BOOST_HANA_ADAPT_STRUCT, or specialize "
                  "spbcast::codec<T> with to_wire/from_wire (README: 'Teaching spbcast a type').");
}

}  // namespace spbcast::detail
