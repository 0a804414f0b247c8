// A projection whose weights are interleaved (interleaved_rows.h) as the threads of a parallel region run it
// (decoder_layers.h's team): each thread quantizes x itself and computes its share of the output's groups
// of 16 rows, by bytes, over all the projection's parts (a Q4_K_M file's q and k in Q5_0 beside v in
// lmport's int8) in one go. The same kernels as ggml_linear / quant_linear on the same codes, so the same
// floats.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "ggml_linear.h"
#include "quant_linear.h"

namespace lmport {

#ifdef LMPORT_INTERLEAVED
// One part: ``groups`` groups of ``group_bytes``, its outputs from column ``column``; ``run`` computes groups
// [begin, end) for M rows of x (their codes) into y (the part's first column; rows y_stride apart).
struct GroupedPart {
  int64_t groups = 0, group_bytes = 0, column = 0;
  std::function<void(const interleaved::BlockCodes* const*, int64_t, int64_t, int64_t, float*, int64_t)> run;
};

class TeamLinear {
 public:
  TeamLinear() = default;

  // x [M, in_features] (rows in_features apart) -> y [M, width()]: member ``member`` of ``members``' share.
  void run_share(int member, int members, const float* x, int64_t M, float* y) const {
    std::vector<interleaved::BlockCodes> codes;
    std::vector<const interleaved::BlockCodes*> rows;
    for (int64_t m = 0; m < M; ++m) codes.push_back(interleaved::block_codes(x + m * in_features_, in_features_));
    for (const auto& c : codes) rows.push_back(&c);
    // A group goes to the member whose share of the bytes holds the group's first byte.
    const int64_t lo = bytes_ * member / members, hi = bytes_ * (member + 1) / members;
    int64_t start = 0;
    for (const GroupedPart& p : parts_) {
      const auto first_at = [&](int64_t at) {
        return std::clamp<int64_t>((at - start + p.group_bytes - 1) / p.group_bytes, 0, p.groups);
      };
      const int64_t begin = first_at(lo), end = first_at(hi);
      if (begin < end) p.run(rows.data(), M, begin, end, y + p.column, width_);
      start += p.groups * p.group_bytes;
    }
  }

  int64_t width() const { return width_; }
  int64_t in_features() const { return in_features_; }

  // The parts as a team runs them, or nothing where one is not interleaved whole (the step then takes the
  // kernels one call at a time).
  template <class Linear>
  static c10::optional<TeamLinear> of(const std::vector<Linear>& linears) {
    TeamLinear team;
    for (const Linear& l : linears) {
      auto part = grouped(l, team.width_);
      if (!part || (team.in_features_ && team.in_features_ != l.input_width())) return c10::nullopt;
      team.in_features_ = l.input_width();
      team.width_ += part->groups * interleaved::kGroup;
      team.bytes_ += part->groups * part->group_bytes;
      team.parts_.push_back(std::move(*part));
    }
    if (team.parts_.empty()) return c10::nullopt;
    return team;
  }

 private:
  template <class Linear>
  static c10::optional<GroupedPart> grouped(const Linear& l, int64_t column) {
    const int64_t N = l.weight.size(0), K = l.input_width();
    if (l.row_group != interleaved::kGroup || N % interleaved::kGroup || !l.weight.is_contiguous() ||
        (l.bias && !(l.bias->is_contiguous() && l.bias->scalar_type() == torch::kFloat)))
      return c10::nullopt;
    const uint8_t* w = reinterpret_cast<const uint8_t*>(l.weight.data_ptr());
    const float* bias = l.bias ? l.bias->template data_ptr<float>() : nullptr;
    GroupedPart part;
    part.groups = N / interleaved::kGroup, part.column = column;
    const auto bind = [&](auto layout, int64_t group_bytes, int64_t blocks) {
      part.group_bytes = group_bytes;
      part.run = [=](const interleaved::BlockCodes* const* x, int64_t M, int64_t begin, int64_t end, float* y,
                     int64_t y_stride) {
        interleaved::groups_range(layout, x, M, K, w, begin, end, group_bytes, blocks, bias, y, y_stride);
      };
    };
    if (l.kind == "quant" && (l.bits == 4 || l.bits == 8) && l.scales.is_contiguous() &&
        (!l.mins || l.mins->is_contiguous())) {
      const at::Half* scales = l.scales.template data_ptr<at::Half>();
      const at::Half* mins = l.mins ? l.mins->template data_ptr<at::Half>() : nullptr;
      const int64_t group_bytes = interleaved::kGroup * K * l.bits / 8;
      if (l.bits == 4) bind(interleaved::QuantRows<4>{scales, mins, K, l.group_size}, group_bytes, 0);
      else bind(interleaved::QuantRows<8>{scales, mins, K, l.group_size}, group_bytes, 0);
    } else if (l.kind == "ggml") {
      ggml_detail::with_type(l.type, [&](auto t) {
        using T = decltype(t);
        using L = typename ggml_detail::RowsOf<T>::type;
        if constexpr (!std::is_void_v<L>)
          bind(L{}, interleaved::kGroup * (K / T::kElements) * T::kBytes, K / T::kElements);
      });
    }
    if (!part.run) return c10::nullopt;
    return part;
  }

  std::vector<GroupedPart> parts_;
  int64_t width_ = 0, in_features_ = 0, bytes_ = 0;
};
#endif

}  // namespace lmport
