// spbcast's own dtype codes. They are part of the wire format and never change meaning; c10's
// ScalarType numbering is an implementation detail of one LibTorch release and is not sent.
#pragma once

#include "../base/version.hpp"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>

namespace spbcast::detail {

// clang-format off
#define SPBCAST_DTYPES_ALWAYS(X)                                        \
    X(1, Bool) X(2, Byte) X(3, Char) X(4, Short) X(5, Int) X(6, Long)   \
    X(7, Half) X(8, BFloat16) X(9, Float) X(10, Double)                 \
    X(11, ComplexHalf) X(12, ComplexFloat) X(13, ComplexDouble)
#if SPBCAST_TORCH_AT_LEAST(2, 1)
#define SPBCAST_DTYPES_2_1(X) X(17, Float8_e5m2) X(18, Float8_e4m3fn)
#else
#define SPBCAST_DTYPES_2_1(X)
#endif
#if SPBCAST_TORCH_AT_LEAST(2, 2)
#define SPBCAST_DTYPES_2_2(X) X(19, Float8_e5m2fnuz) X(20, Float8_e4m3fnuz)
#else
#define SPBCAST_DTYPES_2_2(X)
#endif
#if SPBCAST_TORCH_AT_LEAST(2, 3)
#define SPBCAST_DTYPES_2_3(X) X(14, UInt16) X(15, UInt32) X(16, UInt64)
#else
#define SPBCAST_DTYPES_2_3(X)
#endif
#if SPBCAST_TORCH_AT_LEAST(2, 7)
#define SPBCAST_DTYPES_2_7(X) X(21, Float8_e8m0fnu)
#else
#define SPBCAST_DTYPES_2_7(X)
#endif
#define SPBCAST_DTYPES(X) SPBCAST_DTYPES_ALWAYS(X) SPBCAST_DTYPES_2_1(X) \
    SPBCAST_DTYPES_2_2(X) SPBCAST_DTYPES_2_3(X) SPBCAST_DTYPES_2_7(X)
// clang-format on

inline std::optional<std::uint8_t> dtype_code(c10::ScalarType type) {
    switch (type) {
#define SPBCAST_CASE(code, name) \
    case c10::ScalarType::name: return code;
        SPBCAST_DTYPES(SPBCAST_CASE)
#undef SPBCAST_CASE
        default: return std::nullopt;
    }
}

// A code this build does not know (a newer dtype from a newer LibTorch, or garbage) is
// nullopt; the caller turns it into a clear error.
inline std::optional<c10::ScalarType> dtype_from_code(std::uint8_t code) {
    switch (code) {
#define SPBCAST_CASE(code, name) \
    case code: return c10::ScalarType::name;
        SPBCAST_DTYPES(SPBCAST_CASE)
#undef SPBCAST_CASE
        default: return std::nullopt;
    }
}

}  // namespace spbcast::detail
