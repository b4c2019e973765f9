// Where in the batch we are, for error messages: batch[0].seq_ctx.pixel_values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace spbcast::detail {

class field_path {
public:
    void push_field(std::string_view name, std::size_t position) {
        segments_.push_back({segment::field, name, position, {}});
    }
    void push_index(std::uint64_t index) { segments_.push_back({segment::index, {}, index, {}}); }
    void push_key(std::string key) {
        segments_.push_back({segment::key, {}, 0, std::move(key)});
    }
    void pop() { segments_.pop_back(); }

    std::string str() const {
        std::string out = "batch";
        for (const segment& s : segments_) {
            switch (s.kind) {
                case segment::field:
                    out += '.';
                    // PFR fields have no names before Boost 1.84: show their position.
                    out += s.name.empty() ? "<field " + std::to_string(s.number) + ">"
                                          : std::string(s.name);
                    break;
                case segment::index: out += '[' + std::to_string(s.number) + ']'; break;
                case segment::key: out += "[\"" + s.text + "\"]"; break;
            }
        }
        return out;
    }

private:
    struct segment {
        enum kind_t { field, index, key } kind;
        std::string_view name;
        std::uint64_t number;
        std::string text;
    };
    std::vector<segment> segments_;
};

}  // namespace spbcast::detail
