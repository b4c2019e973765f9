// The one customization point: teach spbcast a type it cannot reflect by itself (private
// members, invariants, handles) by mapping it to a type it can.
//
//   struct Image { /* private members */ };
//   template <> struct spbcast::codec<Image> {
//       static std::tuple<int64_t, at::Tensor> to_wire(const Image& v) { return {v.id(), v.pixels()}; }
//       static Image from_wire(std::tuple<int64_t, at::Tensor>&& w) { return Image(get<0>(w), get<1>(w)); }
//   };
//
// to_wire's result (the wire type) may be any type spbcast supports, tensors included. A
// codec takes precedence over reflection, so it can also override how an aggregate is sent.
#pragma once

#include <type_traits>
#include <utility>

namespace spbcast {

template <class T>
struct codec;  // specialize for your type; left undefined on purpose

template <class T>
concept has_codec = requires(const T& value) { codec<T>::to_wire(value); };

template <has_codec T>
using wire_type_t = std::remove_cvref_t<decltype(codec<T>::to_wire(std::declval<const T&>()))>;

// Neither the wire type nor T needs a default constructor: followers build both from their
// parts (the wire type's fields in order) and hand the wire value to from_wire.
template <class T>
concept has_from_wire = has_codec<T> && requires(wire_type_t<T>&& wire) {
    { codec<T>::from_wire(std::move(wire)) } -> std::convertible_to<T>;
};

}  // namespace spbcast
