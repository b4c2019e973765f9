// What the fuzz target and its seed generator share: the input format and the limits.
//
// One fuzz input is what a follower receives for one broadcast, flattened:
//   byte 0        the batch type the follower expects: even = xtuner::Batch, odd = c10::IValue
//   64 bytes      the frame header (spbcast::detail::frame_header, docs/wire-format.md)
//   body_bytes    the frame body (fewer if the input ends first)
//   the rest      the payload stream: transfer slots, then the status trailer, are filled
//                 from it in order, and with zeros once it runs out
// The header and body checksums are not checked here (a wrong one is refused before
// decoding, see tests/faults/test_hostile_frames.cpp), so every mutation reaches the decoder.
#pragma once

#include <spbcast/options.hpp>

namespace spbcast_fuzz {

// Small limits, so that "never allocates beyond the limits" is checkable with libFuzzer's
// -malloc_limit_mb and -rss_limit_mb (scripts/fuzz.sh).
inline spbcast::limits fuzz_limits() {
    spbcast::limits l;
    l.max_frame_bytes = 1 << 20;
    l.max_tensors = 1024;
    l.max_dims = 16;
    l.max_payload_bytes = 16 << 20;
    l.max_string_bytes = 1 << 16;
    l.max_container_size = 1 << 16;
    l.max_depth = 32;
    return l;
}

}  // namespace spbcast_fuzz
