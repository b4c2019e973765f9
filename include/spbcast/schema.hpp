// The schema of a batch type: a canonical, readable description computed at compile time from
// the type alone, and its 64-bit fingerprint. The root sends both; a follower built with a
// different type sees the two schemas side by side in its error.
//
//   spbcast::schema_of<Batch>       -> "list<xtuner::Item{seq_ctx:xtuner::SequenceContext{...}}>"
//   spbcast::fingerprint_of<Batch>  -> FNV-1a 64 of the schema text
//
// Each kind writes its own part of the text (detail/wire/kinds.hpp lists where); the struct kinds
// (Boost.PFR, Boost.Hana) are the reflection front end, detail/wire/kind_records.hpp.
#pragma once

#include "detail/wire/kind_records.hpp"
#include "detail/wire/schema_text.hpp"
